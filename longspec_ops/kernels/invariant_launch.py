"""Launchers of the batch-invariant kernels (:mod:`.invariant`) and their one fixed configuration per dtype.

Invariance holds between launches of the *same* configuration: every reduction order below (the split-K ranges,
the attention's splits and blocks) is a function of the dtype (and, for attention, of the GQA group size) only,
never of M, the committed length or the batch; only the linear's launch tile follows M, which on tensor cores
changes no bit (:class:`LinearTile`). Overriding ``config`` is for tests and sweeps; a decoder must use one
configuration for its decode and verify forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .attention import _LOG2E
from .configs import _cdiv, _next_pow2, _num_sms
from .invariant import (_invariant_merge_kernel, _invariant_split_kernel, _linear_kernel, _rms_norm_kernel,
                        _split_k_sum_kernel)
from .launch import _dot_precision


@dataclass(frozen=True)
class LinearTile:
    """One launch shape of the invariant linear, used for ``M <= max_m`` rows.

    A tile changes speed, never bits: on tensor cores a row's dot products accumulate in the MMA's 16-element K
    steps, in ascending order, into one float32 accumulator, whatever the tile's rows (16: ``mma``, 64 / 128:
    Hopper warpgroup MMAs), K step, warps or stages. Measured bitwise on the H200 over Llama-3-8B's linears
    (results/h200/NOTES.md, "tiles keep the bits"), and tested on every GPU run
    (``tests/ops/test_invariant_kernels.py::test_linear_tiles_share_bits``)."""

    max_m: int
    block_m: int
    block_k: int
    warps: int = 4
    stages: int = 3


@dataclass(frozen=True)
class InvariantConfig:
    """Fixed tiles of the invariant kernels (every field a sweep knob for the GPU benchmark).

    Attributes:
        linear_tiles: launch shapes of the linear by row count (:class:`LinearTile`; the first whose ``max_m``
            covers M, else the last). Their ``block_k`` must divide ``linear_k_step``.
        linear_block_n: outputs per linear program (every tile).
        linear_k_step: the split-K ranges are multiples of it (the one reduction order every tile follows).
        linear_split_waves: the split-K rule (:func:`linear_split_k`): when the ``cdiv(N, linear_block_n)`` output
            tiles of an M = 1 call fill less than one wave of the device's SMs, K is split so that the M = 1 call
            has about ``linear_split_waves`` waves of programs; 0 never splits.
        linear_split_k: a forced split count instead of the rule (sweeps and tests); None: the rule.
        attn_block_m: rows (query, GQA head) per attention tile; a tile holds ``attn_block_m // G`` queries (raised
            to the next power of two >= G when G is larger).
        attn_block_n: keys per block; ``split``: keys per KV split, a multiple of ``attn_block_n``. Split s covers
            absolute key positions ``[s * split, (s + 1) * split)`` in every launch.
        attn_warps, attn_stages: launch options of the split kernel.
        merge_block_r, merge_block_d: rows and head-dimension columns per merge program; ``merge_block_s``: splits
            merged per step (one fixed-shape reduction; the steps in ascending order).
    """

    linear_tiles: tuple[LinearTile, ...] = (LinearTile(16, 16, 128), LinearTile(64, 64, 128),
                                            LinearTile(1 << 62, 128, 64, warps=8))
    linear_block_n: int = 64
    linear_k_step: int = 128
    linear_split_waves: int = 2
    linear_split_k: Optional[int] = None
    attn_block_m: int = 64
    attn_block_n: int = 64
    split: int = 2048
    attn_warps: int = 4
    attn_stages: int = 3
    merge_block_r: int = 16
    merge_block_s: int = 16
    merge_block_d: int = 32

    def __post_init__(self) -> None:
        for name in ("linear_block_n", "linear_k_step", "attn_block_m", "attn_block_n", "merge_block_d"):
            _check_pow2(f"InvariantConfig.{name}", getattr(self, name), 16)
        for name in ("merge_block_r", "merge_block_s"):
            _check_pow2(f"InvariantConfig.{name}", getattr(self, name), 2)
        if not self.linear_tiles or not all(isinstance(t, LinearTile) for t in self.linear_tiles):
            raise ValueError(f"InvariantConfig.linear_tiles must be a non-empty tuple of LinearTile, "
                             f"got {self.linear_tiles!r}")
        for i, tile in enumerate(self.linear_tiles):
            _check_pow2(f"InvariantConfig.linear_tiles[{i}].block_m", tile.block_m, 16)
            _check_pow2(f"InvariantConfig.linear_tiles[{i}].block_k", tile.block_k, 16)
            if self.linear_k_step % tile.block_k:
                raise ValueError(f"InvariantConfig.linear_tiles[{i}].block_k ({tile.block_k}) must divide "
                                 f"linear_k_step ({self.linear_k_step})")
            if i and tile.max_m <= self.linear_tiles[i - 1].max_m:
                raise ValueError(f"InvariantConfig.linear_tiles must have increasing max_m, got "
                                 f"{[t.max_m for t in self.linear_tiles]}")
        if self.linear_split_waves < 0:
            raise ValueError(f"InvariantConfig.linear_split_waves must be >= 0, got {self.linear_split_waves}")
        if self.linear_split_k is not None and self.linear_split_k < 1:
            raise ValueError(f"InvariantConfig.linear_split_k must be None or >= 1, got {self.linear_split_k}")
        if self.split < self.attn_block_n or self.split % self.attn_block_n:
            raise ValueError(f"InvariantConfig.split must be a positive multiple of attn_block_n "
                             f"({self.attn_block_n}), got {self.split}")

    def linear_tile(self, m: int) -> LinearTile:
        """The launch shape for ``m`` rows."""
        return next((t for t in self.linear_tiles if m <= t.max_m), self.linear_tiles[-1])


def _check_pow2(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value}")


# 16-bit inputs use tensor cores; float32 runs IEEE dots on FMA units and takes small tiles (one tile for every M).
# Split-K (linear_split_waves) fills the SMs at M = 1 for narrow outputs. The 16-bit linear picks its tile by M
# (bits unchanged, see LinearTile): 16 rows at decode, 64 up to a 64-node tree, 128 rows over 8 warps above.
# Swept on the H200 (`python -m benchmarks.sweep_invariant`, results/h200/invariant_sweep.md): summed over
# Llama-3-8B's linears 5.09 / 5.72 / 6.77 ms at M = 1 / 64 / 69 against cuBLAS's 4.98 / 5.11 / 5.18 (one 64-row
# tile for every M: 5.87 / 6.01 / 7.33). Attention (`--no-linears`, invariant_attention_sweep.md): 3 stages over
# 2048-key splits, 42 / 124 us per layer at M = 1 / 69 (32k; fast kernels 38 / 87; 1024-key splits 42 / 134,
# 4096-key 56 / 145, 128-row tiles with 8 warps 53 / 165).
_CONFIGS = {
    True: InvariantConfig(),
    False: InvariantConfig(linear_tiles=(LinearTile(32, 32, 32, stages=2),), linear_block_n=32, linear_k_step=32,
                           attn_block_m=32, attn_block_n=32, attn_stages=1),
}


def invariant_config(dtype: torch.dtype) -> InvariantConfig:
    """The one configuration of ``dtype``'s launches."""
    return _CONFIGS[dtype in (torch.float16, torch.bfloat16)]


_SUM_BLOCK = 1024
_MAX_SPLIT_K = 32  # caps the float32 workspace ([SPLIT_K, M, N]) and the sum kernel's loop


def linear_split_k(N: int, K: int, cfg: InvariantConfig, sms: int) -> tuple[int, int]:
    """``(split_k, k_split)``: how many K ranges of ``k_split`` elements (a multiple of ``linear_k_step``; the
    last range may be shorter) an ``[N, K]`` weight's products are split into. A function of N, K, the config and
    the device's SM count ``sms`` only, never of M: every row of every call on this device reduces in the same
    order."""
    k_blocks = max(1, _cdiv(K, cfg.linear_k_step))
    if cfg.linear_split_k is not None:
        split = cfg.linear_split_k
    else:
        n_tiles = _cdiv(N, cfg.linear_block_n)
        split = 1 if cfg.linear_split_waves == 0 or n_tiles >= sms else \
            _cdiv(cfg.linear_split_waves * sms, n_tiles)
    split = max(1, min(split, k_blocks, _MAX_SPLIT_K))
    k_split = _cdiv(k_blocks, split) * cfg.linear_k_step
    return max(1, _cdiv(K, k_split)), k_split  # no empty ranges


def invariant_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], *,
                     config: Optional[InvariantConfig] = None) -> Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias [N])`` -> ``[..., N]`` in x's dtype, float32 accumulation (split-K
    per :func:`linear_split_k`, the partials summed in a fixed order)."""
    cfg = config or invariant_config(x.dtype)
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.shape[0] > 0 and K > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        split_k, k_split = linear_split_k(N, K, cfg, _num_sms(x.device))
        # split: float32 partials [split_k, M, N], summed in order by _split_k_sum_kernel (bias and cast there)
        dst = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else y
        b = bias if bias is not None else weight
        tile = cfg.linear_tile(M)
        grid = (_cdiv(M, tile.block_m) * _cdiv(N, cfg.linear_block_n), split_k)
        _linear_kernel[grid](
            x2, weight, b, dst, M, N, K, k_split, x2.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, SPLIT=split_k > 1, BLOCK_M=tile.block_m, BLOCK_N=cfg.linear_block_n,
            BLOCK_K=tile.block_k, DOT_PRECISION=_dot_precision(x.dtype), num_warps=tile.warps, num_stages=tile.stages,
        )
        if split_k > 1:
            _split_k_sum_kernel[(_cdiv(M * N, _SUM_BLOCK),)](dst, b, y, M * N, N, split_k,
                                                            HAS_BIAS=bias is not None, BLOCK=_SUM_BLOCK,
                                                            num_warps=4)
    return y.reshape(*x.shape[:-1], N)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Row-wise RMSNorm of ``x [..., H]`` (transformers' LlamaRMSNorm) in ``promote_types(x, weight)``."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if H > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        block = _next_pow2(H)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, H, x2.stride(0), eps, BLOCK=block,
                                         num_warps=4 if block <= 4096 else 8)
    return y.reshape(x.shape)


def invariant_attn(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, ancestors: Tensor,
                   depths: Tensor, scale: float, *, config: Optional[InvariantConfig] = None) -> tuple[Tensor, Tensor]:
    """Split-KV attention with fixed absolute splits (see :mod:`.invariant`); arguments as
    :func:`longspec_ops.reference.invariant.invariant_attn`. Returns out ``[B, M, Hq, D]`` (contiguous, q's dtype)
    and lse float32 ``[B, Hq, M]``."""
    cfg = config or invariant_config(q.dtype)
    B, M, Hq, D = q.shape
    N, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    R = M * G
    out = torch.empty((B, M, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, M), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or N == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    block_m = max(cfg.attn_block_m, _next_pow2(G))
    qpt = block_m // G
    D_PAD = max(16, _next_pow2(D))
    num_splits = _cdiv(N, cfg.split)  # a function of the cache capacity only: graph-capturable
    seqlens = cache_seqlens.to(torch.int32)
    anc = ancestors.to(torch.int32).contiguous()
    dep = depths.to(torch.int32).contiguous()
    ws_o = torch.empty((B * Hkv, num_splits, R, D), dtype=torch.float32, device=q.device)
    ws_lse = torch.empty((B * Hkv, num_splits, R), dtype=torch.float32, device=q.device)
    _invariant_split_kernel[(_cdiv(M, qpt), B * Hkv, num_splits)](
        q, k_cache, v_cache, seqlens, anc, dep, ws_o, ws_lse,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        M, N, Hkv, R, anc.shape[2], num_splits, scale * _LOG2E,
        D=D, D_PAD=D_PAD, G=G, QPT=qpt, BLOCK_M=block_m, BLOCK_N=cfg.attn_block_n, SPLIT=cfg.split,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.attn_warps, num_stages=cfg.attn_stages,
    )
    block_d = min(cfg.merge_block_d, D_PAD)
    _invariant_merge_kernel[(_cdiv(R, cfg.merge_block_r), _cdiv(D, block_d), B * Hkv)](
        ws_o, ws_lse, seqlens, dep, out, lse, M, N, Hkv, R, num_splits,
        D=D, G=G, BLOCK_R=cfg.merge_block_r, BLOCK_S=cfg.merge_block_s, BLOCK_D=block_d, SPLIT=cfg.split,
        num_warps=4,
    )
    return out, lse
