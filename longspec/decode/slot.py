"""A decoder's persistent device state for one batch size, and the CUDA graphs captured on it.

A captured graph replays fixed device addresses, so every tensor a round reads or writes must outlive the graph.
:class:`Slot` holds them for one batch size: the target's KV cache, the token buffer, the round's state (root,
active rows, counts, the remaining-token budget, the stop ids, the seed as data, the budget's report) and the
graphs replayed on them (the target's decode / verify forwards, each option's draft step, each round tail). A
``generate`` call copies its request into the slot and replays what is already there, so graphs are captured
once per slot, not once per call. :meth:`~longspec.decode.decoder.SpeculativeDecoder.warmup` fills the slots of
the batch sizes it is given up front.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from longspec.model.target import StaticKVCache

from .sampling import NoiseKey, noise_key

EOS_CAPACITY = 16  # stop ids a slot holds without reallocating its buffer (unused entries are -1: no token)


@dataclass
class Slot:
    """One batch size's persistent tensors (all on the cache's device) and the graphs captured on them.

    cache:     the target's :class:`~longspec.model.target.StaticKVCache` ``[L, 2, B, N, Hkv, D]``.
    tokens:    int64 ``[B, N + depth + 2]``: room for any request the cache fits, plus a round's writes past it.
    root, active, generated, pending: int64 / bool / int64 / int64 ``[B]`` (see :class:`~longspec.decode.decoder.Run`).
    max_new:   int64 ``[]`` this call's ``max_new_tokens`` (data, so a new length replays the same tail graph).
    eos:       int64 ``[E]`` this call's stop ids, padded with -1.
    seed:      the seed as data (:class:`~longspec.decode.sampling.NoiseKey`; its words are rewritten per call).
    report:    float32 ``[2B + 2K]`` what a budget's sync reads (None without a budget).
    pinned:    made by ``warmup``: kept when a call of another batch size comes (others are replaced).
    forwards / drafts / tails: the captured graphs (:class:`~longspec.decode.graphs.CapturedCall` /
               :class:`~longspec.decode.graphs.CapturedDraft`), keyed as the decoder looks them up.
    """

    cache: StaticKVCache
    tokens: Tensor
    root: Tensor
    active: Tensor
    generated: Tensor
    pending: Tensor
    max_new: Tensor
    eos: Tensor
    seed: NoiseKey
    report: Optional[Tensor]
    pinned: bool = False
    forwards: dict = field(default_factory=dict)
    drafts: dict = field(default_factory=dict)
    tails: dict = field(default_factory=dict)
    dropped_s: float = 0.0  # capture seconds of graphs dropped (their tensors were replaced)
    dropped_n: int = 0

    @classmethod
    def allocate(cls, config, batch: int, rows: int, depth: int, vocab: int, report: int, dtype: torch.dtype,
                 device: torch.device, tp=None) -> "Slot":
        """A slot of ``rows`` cache rows for ``batch`` rows, trees of up to ``depth`` levels, a ``vocab``-token
        target and a budget report of ``report`` values (0: no budget)."""
        cache = StaticKVCache.from_config(config, batch, rows, dtype, device, tp=tp)
        i64 = dict(dtype=torch.int64, device=device)
        zeros = torch.zeros(batch, **i64)
        return cls(
            cache=cache,
            tokens=torch.zeros(batch, rows + depth + 2, **i64),
            root=zeros.clone(),
            active=torch.zeros(batch, dtype=torch.bool, device=device),
            generated=zeros.clone(),
            pending=zeros.clone(),
            max_new=torch.zeros((), **i64),
            eos=torch.full((EOS_CAPACITY,), -1, **i64),
            seed=noise_key(0, vocab, device),
            report=torch.zeros(report, device=device) if report else None,
        )

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    def begin(self, lens: Tensor, root: Tensor, eos: Tensor, max_new: int, seed: Optional[int]) -> None:
        """A call's start after its prefill: ``lens`` committed rows per row, ``root`` pending, its stop ids,
        ``max_new_tokens`` and seed (None: unseeded) as data."""
        self.cache.seqlens.copy_(lens.to(torch.int32))
        self.root.copy_(root)
        self.tokens.scatter_(1, lens[:, None], root[:, None])
        self.set_eos(eos)
        self.active.copy_(~(root[:, None] == self.eos).any(dim=-1) & (max_new > 1))
        self.generated.fill_(1)
        self.pending.zero_()
        self.max_new.fill_(max_new)
        if seed is not None:
            self.set_seed(seed)

    def set_eos(self, ids: Tensor) -> None:
        """This call's stop ids (int64 ``[E]``) into the buffer; a longer list than it holds gets a new buffer
        (and the tail graphs, which read the old one, are dropped)."""
        if ids.numel() > self.eos.numel():
            self.eos = torch.full((ids.numel(),), -1, dtype=torch.int64, device=self.eos.device)
            self.drop(self.tails)
        self.eos.fill_(-1)
        self.eos[: ids.numel()] = ids

    def set_seed(self, seed: int) -> None:
        self.seed.words.copy_(noise_key(seed, 0).words)

    def drop(self, graphs: dict) -> None:
        """Forget ``graphs`` (one of the slot's dicts), counting their capture time as spent."""
        self.dropped_s += sum(g.capture_s for g in graphs.values())
        self.dropped_n += sum(g.count for g in graphs.values())
        graphs.clear()

    def capture_seconds(self) -> float:
        """Seconds spent capturing this slot's graphs over its life (dropped ones included)."""
        return self.dropped_s + sum(g.capture_s for g in self._graphs())

    def captures(self) -> int:
        """Graphs captured on this slot over its life (dropped ones included)."""
        return self.dropped_n + sum(g.count for g in self._graphs())

    def nbytes(self) -> int:
        """Device bytes of the slot's own tensors (the cache and the round state; graph pools not included)."""
        own = [self.cache.kv, self.cache.seqlens, self.tokens, self.root, self.active, self.generated, self.pending,
               self.max_new, self.eos, *self.seed]
        return sum(t.nbytes for t in own) + (self.report.nbytes if self.report is not None else 0)

    def _graphs(self) -> list:
        return [*self.forwards.values(), *self.drafts.values(), *self.tails.values()]


class SlotPool:
    """A decoder's slots by batch size: those made by a warm-up (``pin``) are kept; of the others only the last.

    ``report``: the budget report's length past the 2B active / length entries (2K for K options; 0: no budget).
    """

    def __init__(self, target: torch.nn.Module, depth: int, report: int, max_cache_len: Optional[int], tp) -> None:
        self.target, self.depth, self.report, self.max_cache_len, self.tp = target, depth, report, max_cache_len, tp
        self.slots: dict[int, Slot] = {}
        self.last: Optional[Slot] = None  # the slot of the last call

    def get(self, batch: int, rows: int, pin: bool = False) -> Slot:
        """The slot of this batch size, reused when its cache fits ``rows`` (its graphs and compiled code stay
        valid); otherwise a new one (with a warning when a warm-up made the old one: a request it did not cover)."""
        if self.max_cache_len is not None and rows > self.max_cache_len:
            raise ValueError(f"the request needs {rows} cache rows (prompt + max_new_tokens + scratch rows for one "
                             f"verify step), more than max_cache_len={self.max_cache_len}")
        target = self.target
        dtype, device = target.dtype, target.get_output_embeddings().weight.device
        slot = self.slots.get(batch)
        if slot is None or slot.cache.max_len < rows or slot.cache.kv.dtype != dtype:
            pinned = pin or (slot is not None and slot.pinned)
            if slot is not None and slot.pinned and not pin:
                warnings.warn(f"a request of batch {batch} needs {rows} cache rows, more than warmup() prepared "
                              f"({slot.cache.max_len}): the cache is reallocated and its graphs captured again "
                              f"(warm up with a larger max_context)", stacklevel=4)
            if not pinned:  # one slot for the batch sizes nobody warmed up
                self.slots = {b: s for b, s in self.slots.items() if s.pinned}
            rows = -(-rows // 256) * 256  # round up so later requests can reuse it
            if self.max_cache_len is not None:
                rows = min(rows, self.max_cache_len)
            vocab = target.get_output_embeddings().weight.shape[0]
            report = 2 * batch + self.report if self.report else 0
            slot = Slot.allocate(target.config, batch, rows, self.depth, vocab, report, dtype, device, tp=self.tp)
            slot.pinned = pinned
            # a later, longer request needs a wider buffer: one dynamic dimension, not one compile per width
            torch._dynamo.maybe_mark_dynamic(slot.tokens, 1)
            self.slots[batch] = slot
        slot.pinned = slot.pinned or pin
        slot.cache.seqlens.zero_()
        self.last = slot
        return slot


__all__ = ["EOS_CAPACITY", "Slot", "SlotPool"]
