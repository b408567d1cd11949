"""Launchers of the batch-invariant kernels (:mod:`.invariant`) and their one fixed configuration per dtype.

Invariance holds between launches of the *same* configuration: every tile size below is a function of the dtype
(and, for attention, of the GQA group size) only, never of M, the committed length or the batch. Overriding
``config`` is for tests and sweeps; a decoder must use one configuration for its decode and verify forwards.
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
class InvariantConfig:
    """Fixed tiles of the invariant kernels (every field a sweep knob for the GPU benchmark).

    Attributes:
        linear_block_m, linear_block_n, linear_block_k: the GEMM tile (M rows x N outputs x K step).
        linear_warps, linear_stages: its Triton launch options.
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

    linear_block_m: int = 64
    linear_block_n: int = 64
    linear_block_k: int = 64
    linear_warps: int = 4
    linear_stages: int = 3
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
        for name in ("linear_block_m", "linear_block_n", "linear_block_k", "attn_block_m", "attn_block_n",
                     "merge_block_d"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"InvariantConfig.{name} must be a power of two >= 16, got {value}")
        for name in ("merge_block_r", "merge_block_s"):
            value = getattr(self, name)
            if value < 2 or value & (value - 1):
                raise ValueError(f"InvariantConfig.{name} must be a power of two >= 2, got {value}")
        if self.linear_split_waves < 0:
            raise ValueError(f"InvariantConfig.linear_split_waves must be >= 0, got {self.linear_split_waves}")
        if self.linear_split_k is not None and self.linear_split_k < 1:
            raise ValueError(f"InvariantConfig.linear_split_k must be None or >= 1, got {self.linear_split_k}")
        if self.split < self.attn_block_n or self.split % self.attn_block_n:
            raise ValueError(f"InvariantConfig.split must be a positive multiple of attn_block_n "
                             f"({self.attn_block_n}), got {self.split}")


# 16-bit inputs use tensor cores (64-row tiles: one Hopper warpgroup MMA); float32 runs IEEE dots on FMA units and
# takes small tiles. Split-K (linear_split_waves) fills the SMs at M = 1 for narrow outputs. Swept on the H200
# (`python -m benchmarks.sweep_invariant`, results/h200/invariant_sweep.md): over Llama-3-8B's linears this default
# sums to 1.18x / 1.41x cuBLAS at M = 1 / 69, the best of seven configs at M = 69 (16-row tiles were best at M = 1,
# 1.03x, but 2.1x at M = 69; one config must serve both; 128-row tiles with 8 warps: 1.30x at M = 69 but 1.40x at
# M = 1, invariant_sweep_linears_m128.log). Attention (`--no-linears`, invariant_attention_sweep.md): 3 stages over
# 2048-key splits, 46 / 131 us per layer at M = 1 / 69 (32k; 2 stages 62 / 156, 1024-key splits 43 / 156, 128-key
# blocks or 128-row tiles slower at M = 69).
_CONFIGS = {
    True: InvariantConfig(),
    False: InvariantConfig(linear_block_m=32, linear_block_n=32, linear_block_k=32, linear_stages=2,
                           attn_block_m=32, attn_block_n=32, attn_stages=1),
}


def invariant_config(dtype: torch.dtype) -> InvariantConfig:
    """The one configuration of ``dtype``'s launches."""
    return _CONFIGS[dtype in (torch.float16, torch.bfloat16)]


_SUM_BLOCK = 1024
_MAX_SPLIT_K = 32  # caps the float32 workspace ([SPLIT_K, M, N]) and the sum kernel's loop


def linear_split_k(N: int, K: int, cfg: InvariantConfig, sms: int) -> tuple[int, int]:
    """``(split_k, k_split)``: how many K ranges of ``k_split`` elements (a multiple of ``linear_block_k``; the
    last range may be shorter) an ``[N, K]`` weight's products are split into. A function of N, K, the config and
    the device's SM count ``sms`` only, never of M: every row of every call on this device reduces in the same
    order."""
    k_blocks = max(1, _cdiv(K, cfg.linear_block_k))
    if cfg.linear_split_k is not None:
        split = cfg.linear_split_k
    else:
        n_tiles = _cdiv(N, cfg.linear_block_n)
        split = 1 if cfg.linear_split_waves == 0 or n_tiles >= sms else \
            _cdiv(cfg.linear_split_waves * sms, n_tiles)
    split = max(1, min(split, k_blocks, _MAX_SPLIT_K))
    k_split = _cdiv(k_blocks, split) * cfg.linear_block_k
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
        grid = (_cdiv(M, cfg.linear_block_m) * _cdiv(N, cfg.linear_block_n), split_k)
        _linear_kernel[grid](
            x2, weight, b, dst, M, N, K, k_split, x2.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, SPLIT=split_k > 1, BLOCK_M=cfg.linear_block_m, BLOCK_N=cfg.linear_block_n,
            BLOCK_K=cfg.linear_block_k, DOT_PRECISION=_dot_precision(x.dtype),
            num_warps=cfg.linear_warps, num_stages=cfg.linear_stages,
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
    _invariant_split_kernel[(_cdiv(M, qpt), num_splits, B * Hkv)](
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
