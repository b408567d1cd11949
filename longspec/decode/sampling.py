"""Sampling shared by plain and speculative decoding: logits processing and Gumbel-max draws.

Both paths call :func:`sample_tokens`, so temperature, top-k and top-p act on the target exactly alike (the
``vllm#10198`` lesson). A draw is ``argmax(log p + g)`` with Gumbel noise g, an exact sample from p. With a seed,
g is counter-based: a hash of (seed, batch row, absolute position of the sampled token, token id), so the
speculative verifier draws exactly the noise the plain sampler would at that position and both emit the same
tokens (``reference/verification.md`` section 4). Without a seed, g comes from a ``torch.Generator``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax (never a division by ~0)

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is processed and sampled.

    temperature: ``< 1e-5`` is greedy; top_k: 0 disables; top_p: 1.0 disables; seed: counter-based noise if set.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """float32 log-probabilities ``[..., V]`` of the processed target distribution; -inf outside top-k/top-p.

    Order as in transformers' sampler: temperature, then top-k (ties with the k-th value kept), then top-p (the
    smallest set of most likely tokens whose mass exceeds ``top_p``, from one stable ascending sort).
    """
    scores = logits.float() / max(params.temperature, GREEDY_TEMPERATURE)
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, stable=True)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1.0 - params.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def _mul32(x, c: int):
    # 32-bit wrapping multiply inside int64 without overflow: split c into 16-bit halves (products < 2**48).
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x):
    """lowbias32 (C. Wellons): a bijective 32-bit integer hash. Works on Python ints and int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _combine(h, key):
    return _mix32(((key ^ h) + _GOLDEN) & _MASK32)  # key first: it may be the tensor when h is an int


class NoiseKey(NamedTuple):
    """A seed as data, the form in which :func:`gumbel_noise` takes it inside compiled or captured code (so the
    value is not baked in): ``words`` int64 ``[2]`` (the seed's low and high 32-bit words) and ``tokens`` int64
    ``[V]``, every token id's hash. The token hashes are computed eagerly here: Inductor indexes ``arange(V)`` in
    int32 and cannot add the hash's 32-bit constant to it (torch 2.11: "Scalar 2654435769 is out of range for type
    int32"), so compiled code only combines them."""

    words: Tensor
    tokens: Tensor


def _token_hashes(vocab_size: int, device: torch.device | str | None) -> Tensor:
    return _mix32((torch.arange(vocab_size, device=device, dtype=torch.int64) + _GOLDEN) & _MASK32)


def noise_key(seed: int, vocab_size: int, device: torch.device | str | None = None) -> NoiseKey:
    """``seed`` in ``[0, 2**64)`` as a :class:`NoiseKey` for a ``vocab_size``-token vocabulary."""
    words = torch.tensor([seed & _MASK32, (seed >> 32) & _MASK32], dtype=torch.int64, device=device)
    return NoiseKey(words, _token_hashes(vocab_size, device))


def gumbel_noise(seed: int | NoiseKey, rows: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Counter-based Gumbel noise, float32 ``[B, P, V]``, keyed by (seed, rows[b], positions[b, p], token).

    Args:
        seed: int in ``[0, 2**64)``, or its :func:`noise_key` (the same noise; its ``tokens`` must have
            ``vocab_size`` entries).
        rows: int64 ``[B]`` request ids (the batch row in the caller's input).
        positions: int64 ``[B, P]`` absolute positions of the tokens being sampled.

    The same key gives the same value on any device and in any batch composition; 24 bits per uniform, so the
    uniforms are exact in float32 and lie strictly inside (0, 1).
    """
    if isinstance(seed, NoiseKey):
        (lo, hi), tok = seed.words, seed.tokens
    else:
        lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
        tok = _token_hashes(vocab_size, positions.device)
    h = _combine(_combine(0x243F6A88, lo), hi)
    h = _combine(h, rows.to(torch.int64) & _MASK32)  # [B]
    h = _combine(h[:, None], positions.to(torch.int64) & _MASK32)  # [B, P]
    bits = _combine(h[:, :, None], tok) >> 8  # [B, P, V], 24 bits
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def _generator_gumbel(like: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    # rand_like draws what rand would from the default generator; it also traces under a dynamic batch, where
    # torch.rand(symbolic shape, generator=None) fails in torch.compile ("expected to contain only concrete integers")
    u = torch.rand_like(like) if generator is None else torch.rand(like.shape, device=like.device, generator=generator)
    u = u.clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def sample_tokens(
    logits: Tensor,
    params: SamplingParams,
    positions: Tensor,
    generator: Optional[torch.Generator] = None,
    position_index: Optional[Tensor] = None,
    rows: Optional[Tensor] = None,
    seed: Optional[NoiseKey] = None,
) -> Tensor:
    """Draw one token per ``[B, M]`` distribution from target logits ``[B, M, V]``; returns int64 ``[B, M]``.

    Args:
        positions: int64 ``[B, P]`` absolute positions of the sampled tokens (the noise key); ``P = M`` unless
            ``position_index`` (int64 ``[M]``, or ``[B, M]`` when rows differ) maps each of the M distributions to
            one of P shared positions (tree nodes of one depth share a position, so a round hashes only depth + 1
            noise vectors per row).
        generator: the noise source when ``params.seed`` is None.
        rows: int64 ``[B]`` request ids for the seeded noise; default ``arange(B)``.
        seed: ``params.seed`` as :func:`noise_key` (used instead of its value when ``params.seed`` is set), so
            one compiled graph serves every seed.

    Greedy (``temperature < 1e-5``) is ``argmax`` of the raw logits (lowest index on ties).
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    logp = process_logits(logits, params)
    if params.seed is None:
        return (logp + _generator_gumbel(logp, generator)).argmax(dim=-1)
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    noise = gumbel_noise(params.seed if seed is None else seed, rows, positions, logits.shape[-1])
    if position_index is not None and position_index.dim() == 1:
        noise = noise.index_select(1, position_index)
    elif position_index is not None:
        noise = noise.gather(1, position_index[:, :, None].expand(-1, -1, noise.shape[-1]))
    return (logp + noise).argmax(dim=-1)
