"""Triton kernels for tree, prefix and hybrid tree attention: GQA-packed split-KV (flash-decoding) attention.

One kernel family serves the three ops:

* ``_split_attn_kernel`` computes one program's partial attention. A program owns one *row tile* of one
  ``(batch, kv head)`` pair: the tile's rows are ``(query m, head g of the GQA group)`` pairs (row ``r = m * G + g``),
  so every K/V block is loaded once per kv head and multiplied against all G query heads with one ``tl.dot``
  (FlashInfer's head-group fusion). It runs an online softmax (FlashAttention-2) over

  - the cache rows of its KV *split* (flash-decoding): split ``s`` covers rows ``[s * split_rows, (s+1) * split_rows)``
    intersected with each row's visible prefix ``[0, kv_len)``;
  - and/or, in the last split (after its cache rows), the M tree keys under the bool tree mask (the paper's
    ``fused_mask_attn``).

  It writes either the final ``(out, lse)`` (a single split) or a float32 partial ``(out, lse)`` to a workspace.
* ``_merge_splits_kernel`` merges the partials of all splits exactly by their log-sum-exp. Because the tree block is
  part of the last split, the prefix/tree merge of hybrid tree attention costs nothing extra (a tree split of its
  own cost 24 more programs and partials at Llama-3-8B shapes for ~2.5% of one split's keys).

On sm_90+ GPUs the cache blocks of 16-bit caches with 16-byte aligned layouts arrive by TMA (host-built tensor
descriptors; other caches use pointer loads), and the merge is launched with programmatic dependent launch (PDL) so
it is resident before the split kernel ends (each measured on and off: benchmarks/results/h200/paths.md). On sm_90
GPUs, many packed rows (tree verification) take a Gluon kernel instead of ``_split_attn_kernel``
(:mod:`.attention_sm90`, chosen by :func:`split_config` and ``AttnConfig.wgmma``): same partials, same merge, about
20% faster there.

The number of splits depends only on shapes (cache capacity N, B, Hkv, M, the SM count), never on tensor values,
so launches are CUDA-graph capturable; lengths are read (and clamped into ``[0, N]``) on the device.

Numerics: scores are kept in log2 units (``qk * scale * log2(e)``) so the softmax uses ``exp2``; accumulation is
float32; a query that sees no key gets out 0 and lse -inf, never NaN. float64 inputs take the PyTorch reference.

References:
  * Y. Yang et al., "LongSpec: Long-Context Lossless Speculative Decoding with Efficient Drafting and
    Verification", arXiv:2502.17421 (hybrid tree attention, fused_mask_attn).
  * T. Dao, "FlashAttention-2", arXiv:2307.08691 (online softmax, tiling).
  * T. Dao, D. Haziza, F. Massa, G. Sizov, "Flash-Decoding for long-context inference", 2023
    (https://crfm.stanford.edu/2023/10/12/flashdecoding.html) (split-KV + LSE reduction).
  * Z. Ye et al., "FlashInfer", arXiv:2501.01005 (GQA head-group fusion, attention-state merging).
  * Triton fused-attention tutorial (python/tutorials/06-fused-attention.py).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ..reference import attention as _ref


# Configs --------------------------------------------------------------------------------------------------------
# A program's fixed cost in the split rule (launch slot, Q load, partial store and its share of the merge),
# expressed in cache rows: ~128 rows plus the workspace traffic of its tile (block_m * D * 8 bytes written and
# read back, against 4 * D bytes per 16-bit K+V row => 2 * block_m rows, added by plan_splits).
_SPLIT_OVERHEAD_ROWS = 128


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of one attention launch; every field is a sweep knob for the GPU benchmarks.

    Attributes:
        block_m: packed ``(query, group head)`` rows per program (power of two, >= 16 for ``tl.dot``).
        block_n: KV rows per inner-loop step (power of two, >= 16).
        num_warps, num_stages: Triton launch options of the split kernel.
        occupancy: split-kernel programs expected to co-reside on one SM; the split rule fills
            ``num_sms * occupancy`` slots.
        split_rows: cache rows per KV split (rounded up to ``block_n``); ``None`` lets the shape-only split rule
            choose. Forcing a small value exercises many splits.
        split_overhead_rows: the split rule's fixed cost of one program, in cache rows (:func:`plan_splits`).
        merge_num_warps: warps of the split-merge kernel (its tile follows from the split count: merge_tile).
        tma: load cache blocks by TMA where :func:`tma_eligible` allows it; False: pointer loads. Both are exact
            and gave the same bits on the H200; TMA is 1-4% faster there (paths.md), but the descriptors cost
            ~40 us of host time per eager launch in Triton 3.6's launcher (benchmarks/results/h200/eager.md);
            CUDA graphs pay it once, at capture. (Choosing by capture state instead would compile the TMA kernel
            during capture, after an eager warm-up: the H200 run of 11c4e06 failed that way.)
        pdl: launch the split merge with programmatic dependent launch on sm_90+ GPUs, so it is resident and
            waiting when the split kernel ends; False: a plain launch.
        wgmma: run the split-KV part as the Gluon Hopper kernel (:mod:`.attention_sm90`: async wgmma, softmax
            overlapped with P @ V) where it applies: an sm_90 GPU, fp16/bf16, head dim 64 or 128, one length per
            batch row, TMA-eligible caches, two or more splits. Needs ``block_m = 64`` and ``num_warps = 4``
            (``block_n`` and ``num_stages`` size its K/V ring). Elsewhere the Triton kernel runs this config.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    occupancy: int = 1
    split_rows: Optional[int] = None
    merge_num_warps: int = 4
    split_overhead_rows: int = _SPLIT_OVERHEAD_ROWS
    tma: bool = True
    pdl: bool = True
    wgmma: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"AttnConfig.{name} must be a power of two >= 16, got {value}")
        if self.wgmma and (self.block_m != 64 or self.num_warps != 4 or self.block_n > 128):
            raise ValueError("AttnConfig.wgmma needs block_m = 64, num_warps = 4 and block_n <= 128 (one warpgroup "
                             f"per 64-row tile), got block_m={self.block_m}, num_warps={self.num_warps}, "
                             f"block_n={self.block_n}")
        if self.split_rows is not None and self.split_rows < 1:
            raise ValueError(f"AttnConfig.split_rows must be positive, got {self.split_rows}")


# Tables are scanned in order; the first row with head_dim <= max_d and packed rows (M * G) <= max_rows wins.
# "wide" marks 16-bit inputs (fp16/bf16: tensor cores); float32 runs IEEE dots on FMA units (exact, slow) and needs
# small tiles. Hopper (H200) defaults, to be swept. Offline sm_90 compiles (ptxas, Triton 3.6) of every row below
# show no register spills; registers/smem at D = 128: 16 rows 168 regs 70 KiB, 32 rows 238 regs 76 KiB, 64 rows
# 255 regs 114 KiB, 128 rows (8 warps) 228 regs 132 KiB.
#   * <= 16 rows (decode, M = 1 with G <= 16): memory bound. 3 stages of 128-row K and V blocks (cp.async); swept
#     on the H200 (benchmarks/sweep_attention.py, results/h200/sweep.json): 39.4 us at 32k with the rule's 16 splits,
#     44-52 us with 8 / 32 / 64 forced splits, 39.7-42.8 us with 64-row blocks (repeat runs differ by ~1 us).
#   * 17..64 rows: still mostly bandwidth bound; one warp group.
#   * > 64 rows (tree verification, e.g. 69..74 tokens x G = 4): compute bound at long context (each K/V byte feeds
#     ~300 rows); 128-row tiles run two wgmma warp groups and halve re-reads of K/V across row tiles.
#     The last tile is mostly padding there (296 rows = 2 x 128 + 40). Tried on the H200 and dropped: that tile as a
#     64-row tile, inside the launch (a branch on the program id: 138 vs 132 us at 32k, 449 vs 415 at 128k) or as a
#     second launch with a 4-warp config and its own split plan (143 vs 128 us at 32k). Both were slower.
_INF_ROWS = 1 << 30
_SPLIT_TABLE: tuple[tuple[int, int, bool, AttnConfig], ...] = (
    # max_d, max_rows, wide, config
    (128, 16, True, AttnConfig(block_m=16, block_n=128, num_warps=4, num_stages=3, occupancy=1)),
    (128, 32, True, AttnConfig(block_m=32, block_n=64, num_warps=4, num_stages=3, occupancy=2)),
    (128, 64, True, AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, occupancy=1)),
    (128, _INF_ROWS, True, AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, occupancy=1)),
    (256, 16, True, AttnConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, occupancy=2)),
    (256, 64, True, AttnConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, occupancy=1)),
    (256, _INF_ROWS, True, AttnConfig(block_m=128, block_n=32, num_warps=8, num_stages=2, occupancy=1)),
    (64, _INF_ROWS, False, AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=2, occupancy=2)),
    (256, _INF_ROWS, False, AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, occupancy=2)),
)
# Many rows on an sm_90 GPU (tree verification): the Gluon wgmma kernel. 64-row tiles (296 rows -> 320), 3 stages
# of 64-row K and V blocks: 96 KiB of shared memory and 210-212 registers at D = 128 (offline sm_90 compiles with
# Triton 3.6 / 3.8, tests/ops/test_sm90_kernel.py), so two programs share an SM. Its fixed cost per program is
# larger in the split rule: forced split counts on the H200 (74-token tree, B = 1) preferred one wave of 6 splits at
# 32k (92.0 us, against 95.1 with the split the rule chose at a 128-row overhead and 110.5 with 26) and two waves of
# 13 at 128k (314 us, 331 with 6 or 26; sm90_exploration.json); an overhead of 512 rows selects both.
_SM90_SPLIT = AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, occupancy=2, wgmma=True,
                         split_overhead_rows=512)
# Tree attention alone: at most 256 keys, so a program does a few steps and pipelining depth matters little.
_TREE_TABLE: tuple[tuple[int, int, bool, AttnConfig], ...] = (
    (128, 16, True, AttnConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)),
    (128, 32, True, AttnConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)),
    (128, 64, True, AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
    (128, _INF_ROWS, True, AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)),
    (256, 16, True, AttnConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)),
    (256, 64, True, AttnConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)),
    (256, _INF_ROWS, True, AttnConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)),
    (64, _INF_ROWS, False, AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)),
    (256, _INF_ROWS, False, AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)),
)

# Split rule bounds.
_MAX_SPLITS = 256  # caps the search and the workspace
_MAX_WAVES = 4  # more splits than ~4 waves of programs only adds merge work
_INTERPRETER_SMS = 4  # CPU tensors (Triton interpreter): a nominal SM count, so the split rule still splits

_LOG2E = 1.4426950408889634  # the kernels work in log2 units: exp2 is the native SFU instruction
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # log2-unit lse -> natural log, inside the kernels


class HybridBackend(enum.Enum):
    """How :func:`hybrid_tree_attn` is computed (a benchmarking choice; both are exact)."""

    FUSED = "fused"  # the tree block is part of the last split of one split-KV launch; the split merge merges it
    COMPOSED = "composed"  # prefix_attn + tree_attn + longspec::merge_attn_states (the paper's composition)


# Kernels --------------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_step(acc, m_i, l_i, qk, v, qk_scale, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax update with raw scores ``qk`` [BLOCK_M, BLOCK_N] (-inf where hidden).

    The scale (softmax scale x log2 e, > 0) is applied in the exponent, so each score costs one fused multiply-add
    (``qk * scale - m``) before ``exp2``; the running max ``m_i`` is in scaled (log2) units.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P goes to the tensor cores in V's dtype, as in FlashAttention; the accumulator stays float32.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_cache(
    acc, m_i, l_i, q,
    k_base, v_base,  # K/V of this (batch, kv head): row n at base + n * stride
    stride_kn, stride_vn,
    start, end,  # key rows [start, end); start - split start is a multiple of BLOCK_N
    row_len,  # [BLOCK_M] visible prefix length of each tile row
    qk_scale, offs_n, offs_d, d_ok,
    k_desc, v_desc, b, hk,  # TMA descriptors of the [B, N, Hkv, D] caches, and this program's (batch, kv head)
    KEY_MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    # Advance pointers instead of recomputing n * stride: the scalar start offset is 64-bit (1M-row caches),
    # the per-tile offsets stay 32-bit.
    k_ptrs = k_base + start.to(tl.int64) * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
    v_ptrs = v_base + start.to(tl.int64) * stride_vn + (offs_n[:, None] * stride_vn + offs_d[None, :])
    for n0 in range(start, end, BLOCK_N):
        if USE_TMA:
            # TMA (Hopper's tensor memory accelerator) copies the [BLOCK_N, D_PAD] block into shared memory
            # asynchronously; rows past N and columns past D arrive as zeros.
            k = k_desc.load([b, n0, hk, 0]).reshape(BLOCK_N, D_PAD)
            v = v_desc.load([b, n0, hk, 0]).reshape(BLOCK_N, D_PAD)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if KEY_MASK:
                cols = n0 + offs_n
                key_ok = cols < end
                visible = key_ok[None, :] & (cols[None, :] < row_len[:, None])
                qk = tl.where(visible, qk, float("-inf"))
                # Rows in [end, N) are loaded too and may hold anything (unwritten cache capacity): p = 0 there,
                # but 0 * NaN = NaN, so zero V's hidden rows as the masked pointer loads do.
                v = tl.where(key_ok[:, None], v, 0.0)
        elif KEY_MASK:
            cols = n0 + offs_n
            key_ok = cols < end
            k = tl.load(k_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            visible = key_ok[None, :] & (cols[None, :] < row_len[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        else:
            # Interior blocks: every row of the tile sees every key, so no mask work at all.
            if EVEN_D:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, qk_scale, KEY_MASK, DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i


@triton.jit
def _attend_tree(
    acc, m_i, l_i, q,
    kt_base, vt_base,  # tree K/V of this (batch, kv head): key j at base + j * stride
    stride_ktm, stride_vtm,
    mask_rows,  # [BLOCK_M] pointers to tree_mask[b, m_r, 0] (uint8 view of the bool mask)
    stride_mn,
    n_keys,  # M in the last split, 0 elsewhere (the loop is then empty)
    row_ok, qk_scale, offs_n, offs_d, d_ok,
    TREE_BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    for j0 in range(0, n_keys, TREE_BLOCK_N):
        cols = j0 + offs_n
        key_ok = cols < n_keys
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(kt_base + cols[:, None] * stride_ktm + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vt_base + cols[:, None] * stride_vtm + offs_d[None, :], mask=kv_mask, other=0.0)
        # Visible only where the mask is True AND the key exists AND the row exists (all three: &, never |).
        bits = tl.load(mask_rows[:, None] + cols[None, :] * stride_mn,
                       mask=row_ok[:, None] & key_ok[None, :], other=0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        qk = tl.where(bits != 0, qk, float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, qk_scale, True, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _split_attn_kernel(
    Q,  # (B, M, Hq, D), any strides with stride(-1) == 1
    K, V,  # (B, N, Hkv, D) cache, stride(-1) == 1
    KD, VD,  # TMA descriptors of K and V, block [1, BLOCK_N, 1, D_PAD]  [USE_TMA]
    LENS,  # (B,) or (B, M) int32/int64 visible prefix lengths (clamped into [0, N] here)
    KT, VT,  # (B, M, Hkv, D) tree keys/values, stride(-1) == 1
    TMASK,  # (B, M, M) uint8 view of the bool tree mask
    OUT,  # (B, M, Hq, D) contiguous, Q's dtype          [DIRECT_OUT]
    LSE,  # (B, Hq, M) float32, natural log             [DIRECT_OUT]
    WS_O,  # (B * Hkv, S, R, D) float32 partial outputs  [not DIRECT_OUT]
    WS_LSE,  # (B * Hkv, S, R) float32 partial lse, log2 units
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_lb, stride_lm,  # stride_lm = 0 for (B,) lengths
    stride_ktb, stride_ktm, stride_kth,
    stride_vtb, stride_vtm, stride_vth,
    stride_tb, stride_tm, stride_tn,
    M, N, HKV, R,  # R = M * G packed rows per (batch, kv head)
    split_rows, num_splits,  # cache rows per split; total splits S (the last also takes the tree keys)
    qk_scale,  # softmax scale * log2(e)
    D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TREE_BLOCK_N: tl.constexpr,
    HAS_CACHE: tl.constexpr, HAS_TREE: tl.constexpr, DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        # Programmatic dependent launch: the merge kernel may start launching now; it waits (gdc_wait) for this
        # grid to finish and its writes to be visible before reading the partials.
        gdc_launch_dependents()
    # Row tiles vary fastest so the programs that share one K/V split run together and re-reads hit L2.
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV

    rows = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    m_r = rows // G  # query index of each packed row
    h_r = hk * G + rows % G  # query head of each packed row
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    EVEN_D: tl.constexpr = D == D_PAD

    q_ptrs = Q + b * stride_qb + (m_r[:, None] * stride_qm + h_r[:, None] * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    if HAS_CACHE:
        lens = tl.load(LENS + b * stride_lb + m_r * stride_lm, mask=row_ok, other=0)
        row_len = tl.minimum(tl.maximum(lens, 0), N).to(tl.int32)  # a bad length never reads past the cache
        tile_max = tl.max(tl.where(row_ok, row_len, 0), 0)
        tile_min = tl.min(tl.where(row_ok, row_len, N), 0)
        lo = split * split_rows
        hi = tl.minimum(lo + split_rows, tile_max)
        # [lo, full_end): whole blocks every row sees (no masks); [full_end, hi): the ragged tail.
        full_end = lo + tl.maximum(tl.minimum(hi, tile_min) - lo, 0) // BLOCK_N * BLOCK_N
        k_base = K + b * stride_kb + hk * stride_kh
        v_base = V + b * stride_vb + hk * stride_vh
        acc, m_i, l_i = _attend_cache(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, lo, full_end,
                                      row_len, qk_scale, offs_n, offs_d, d_ok, KD, VD, bh // HKV, hk,
                                      False, EVEN_D, BLOCK_N, D_PAD, DOT_PRECISION, USE_TMA)
        acc, m_i, l_i = _attend_cache(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, full_end, hi,
                                      row_len, qk_scale, offs_n, offs_d, d_ok, KD, VD, bh // HKV, hk,
                                      True, EVEN_D, BLOCK_N, D_PAD, DOT_PRECISION, USE_TMA)

    if HAS_TREE:
        n_keys = tl.where(split == num_splits - 1, M, 0)
        offs_t = tl.arange(0, TREE_BLOCK_N)
        kt_base = KT + b * stride_ktb + hk * stride_kth
        vt_base = VT + b * stride_vtb + hk * stride_vth
        mask_rows = TMASK + b * stride_tb + m_r * stride_tm
        acc, m_i, l_i = _attend_tree(acc, m_i, l_i, q, kt_base, vt_base, stride_ktm, stride_vtm, mask_rows,
                                     stride_tn, n_keys, row_ok, qk_scale, offs_t, offs_d, d_ok,
                                     TREE_BLOCK_N, DOT_PRECISION)

    # Empty rows (l = 0) have acc = 0: out 0, lse -inf.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    st_mask = row_ok[:, None] & d_ok[None, :]
    if DIRECT_OUT:
        out_ptrs = OUT + b * (M * HKV * G * D) + (m_r[:, None] * (HKV * G * D) + h_r[:, None] * D + offs_d[None, :])
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=st_mask)
        tl.store(LSE + b * (HKV * G * M) + h_r * M + m_r, lse2 * _LN2, mask=row_ok)
    else:
        ws = (bh.to(tl.int64) * num_splits + split) * R
        tl.store(WS_O + ws * D + (rows[:, None] * D + offs_d[None, :]), o, mask=st_mask)
        tl.store(WS_LSE + ws + rows, lse2, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    WS_O,  # (B * Hkv, S, R, D) float32 partial outputs
    WS_LSE,  # (B * Hkv, S, R) float32 partial lse, log2 units (-inf: empty partial)
    OUT,  # (B, M, Hq, D) contiguous, Q's dtype
    LSE,  # (B, Hq, M) float32, natural log
    M, HKV, R, num_splits,
    D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # the split kernel's partials are complete and visible past this point
    pid_r = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_s = tl.arange(0, BLOCK_S)
    ws = bh.to(tl.int64) * num_splits * R

    # BLOCK_S splits per step as one [BLOCK_R, BLOCK_S, D] tile: every load of a step is independent, so a short
    # merge (decode: a few rows, ~16 splits) costs one memory round trip, not one per split. Online across steps.
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D_PAD], dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        splits = s0 + offs_s
        ok = row_ok[:, None] & (splits < num_splits)[None, :]
        part_lse = tl.load(WS_LSE + ws + (splits[None, :] * R + rows[:, None]), mask=ok, other=float("-inf"))
        o = tl.load(WS_O + (ws + splits[None, :, None] * R + rows[:, None, None]) * D + offs_d[None, None, :],
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(part_lse, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all partials empty so far: weights 0, not NaN
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(part_lse - m_use[:, None])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        den = den * alpha + tl.sum(w, 1)
        m = m_new
    seen = den > 0.0
    den_safe = tl.where(seen, den, 1.0)
    out = acc / den_safe[:, None]
    lse = tl.where(seen, (tl.where(seen, m, 0.0) + tl.log2(den_safe)) * _LN2, float("-inf"))

    m_r = rows // G
    h_r = hk * G + rows % G
    out_ptrs = OUT + b * (M * HKV * G * D) + (m_r[:, None] * (HKV * G * D) + h_r[:, None] * D + offs_d[None, :])
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * (HKV * G * M) + h_r * M + m_r, lse, mask=row_ok)


# Launchers ------------------------------------------------------------------------------------------------------
def _pick(table, head_dim: int, rows: int, dtype: torch.dtype) -> AttnConfig:
    wide = dtype in (torch.float16, torch.bfloat16)
    for max_d, max_rows, table_wide, cfg in table:
        if head_dim <= max_d and rows <= max_rows and wide == table_wide:
            return cfg
    raise ValueError(f"longspec kernels: no tile config for head_dim {head_dim} ({dtype}); head dims up to 256")


def split_config(head_dim: int, rows: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> AttnConfig:
    """The default split-KV config for ``rows = M * (Hq // Hkv)`` packed rows (prefix and hybrid attention) on
    ``device`` (None: a device-independent Triton config)."""
    if (device is not None and _capability(device) == (9, 0) and rows > 64 and head_dim in (64, 128)
            and dtype in (torch.float16, torch.bfloat16)):
        return _SM90_SPLIT
    return _pick(_SPLIT_TABLE, head_dim, rows, dtype)


def tree_config(head_dim: int, rows: int, dtype: torch.dtype) -> AttnConfig:
    """The default config of tree attention alone."""
    return _pick(_TREE_TABLE, head_dim, rows, dtype)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: sm_90+ (the interpreter cannot run its PTX)."""
    return _capability(device) >= (9, 0)


def tma_eligible(cache: Tensor) -> bool:
    """Whether a ``[B, N, Hkv, D]`` cache can be read through a TMA descriptor: a 16-bit dtype (the tensor-core
    path), a 16-byte aligned base, 16-byte multiple strides and a contiguous last dim, on an sm_90+ GPU or in the
    Triton interpreter (which emulates descriptors, so the CPU tests run this path). Other caches use pointer loads.
    """
    if cache.dtype not in (torch.float16, torch.bfloat16):
        return False
    if cache.device.type == "cuda" and _capability(cache.device) < (9, 0):
        return False
    elt = cache.element_size()
    return (cache.data_ptr() % 16 == 0 and cache.stride(-1) == 1
            and all(st * elt % 16 == 0 for st in cache.stride()[:-1]))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def plan_splits(n_rows: int, base_programs: int, block_m: int, block_n: int, slots: int,
                split_rows: Optional[int] = None, overhead_rows: int = _SPLIT_OVERHEAD_ROWS) -> tuple[int, int]:
    """``(num_splits, split_rows)`` for a cache of ``n_rows`` rows: a function of shapes only (graph-safe).

    ``base_programs`` = B * Hkv * row tiles programs share each split; ``slots`` = SMs x occupancy. Model: all
    programs do equal work, run in waves of ``slots``; minimise waves x (rows per split + fixed cost).
    """
    if n_rows <= 0:
        return 0, block_n
    if split_rows is not None:
        # Keep grid axis 1 within CUDA's 65535 even for a tiny forced split size.
        rows = max(split_rows, _cdiv(n_rows, 65535))
        rows = _cdiv(rows, block_n) * block_n
        return _cdiv(n_rows, rows), rows
    overhead = overhead_rows + 2 * block_m
    max_splits = min(_cdiv(n_rows, block_n), _MAX_SPLITS, max(1, _cdiv(_MAX_WAVES * slots, base_programs)))
    best = None
    for s in range(1, max_splits + 1):
        rows = _cdiv(_cdiv(n_rows, s), block_n) * block_n
        splits = _cdiv(n_rows, rows)
        cost = _cdiv(base_programs * splits, slots) * (rows + overhead)
        if best is None or cost < best[0]:
            best = (cost, splits, rows)
    return best[1], best[2]


_MERGE_TILE_ELEMS = 4096  # float32 elements of one merge step's [rows, splits, D] tile (32 per thread at 4 warps)


def merge_tile(num_splits: int, rows: int, d_pad: int) -> tuple[int, int]:
    """``(BLOCK_S, BLOCK_R)`` of the split merge: up to 32 splits per step, as many rows as the tile then holds."""
    block_s = min(32, _next_pow2(num_splits))
    block_r = max(1, min(_next_pow2(rows), _MERGE_TILE_ELEMS // (block_s * d_pad)))
    return block_s, block_r


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs must not silently drop to TF32 (10-bit mantissa): exact IEEE products, like the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _attention(
    q: Tensor,
    cache: Optional[tuple[Tensor, Tensor, Tensor]],
    tree: Optional[tuple[Tensor, Tensor, Tensor]],
    scale: float,
    cfg: AttnConfig,
) -> tuple[Tensor, Tensor]:
    """One split launch (+ one merge launch when there is more than one split). ``cache`` = (k, v, lens),
    ``tree`` = (k, v, mask)."""
    B, M, Hq, D = q.shape
    Hkv = (cache if cache is not None else tree)[0].shape[2]
    G = Hq // Hkv
    R = M * G
    out = torch.empty((B, M, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, M), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse

    D_PAD = max(16, _next_pow2(D))
    row_tiles = _cdiv(R, cfg.block_m)
    N = cache[0].shape[1] if cache is not None else 0
    has_cache = cache is not None and N > 0  # an empty cache contributes nothing: skip its loads entirely
    n_cache, split_rows = 0, cfg.block_n
    if has_cache:
        slots = _num_sms(q.device) * cfg.occupancy
        n_cache, split_rows = plan_splits(N, B * Hkv * row_tiles, cfg.block_m, cfg.block_n, slots, cfg.split_rows,
                                          cfg.split_overhead_rows)
    num_splits = max(1, n_cache)  # the tree keys, if any, join the last split (the only split without a cache)
    direct = num_splits == 1

    # Unused pointer arguments get q (never dereferenced: their code is compiled out by the constexpr flags).
    k, v, lens = cache if has_cache else (q, q, q)
    kt, vt, mask = tree if tree is not None else (q, q, None)
    mask = mask.view(torch.uint8) if mask is not None else q  # bool -> uint8 view: no copy, no int64 masks
    lens_strides = (0, 0) if not has_cache else (lens.stride(0), lens.stride(1) if lens.dim() == 2 else 0)
    if direct:
        ws_o, ws_lse = out, lse  # unused
    else:
        ws_o = torch.empty((B * Hkv, num_splits, R, D), dtype=torch.float32, device=q.device)
        ws_lse = torch.empty((B * Hkv, num_splits, R), dtype=torch.float32, device=q.device)

    def s3(t):  # (batch, row, head) strides of a [B, S, H, D] tensor
        return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)

    tree_strides = (*s3(kt), *s3(vt),
                    *((mask.stride(0), mask.stride(1), mask.stride(2)) if tree is not None else (0, 0, 0)))
    pdl = cfg.pdl and not direct and _has_pdl(q.device)
    if cfg.wgmma and has_cache and _wgmma_applies(q, k, v, lens, D, num_splits):
        _launch_sm90(q, k, v, lens, kt, vt, mask, ws_o, ws_lse, (*s3(q), lens_strides[0], *tree_strides),
                     M, N, Hkv, R, G, D, split_rows, num_splits, scale, cfg, tree is not None)
    else:
        tree_block_n = min(cfg.block_n, max(16, _next_pow2(M)))
        use_tma = cfg.tma and has_cache and tma_eligible(k) and tma_eligible(v)
        if use_tma:
            block = [1, cfg.block_n, 1, D_PAD]
            kd = TensorDescriptor(k, list(k.shape), list(k.stride()), block)
            vd = TensorDescriptor(v, list(v.shape), list(v.stride()), block)
        else:
            kd, vd = q, q  # unused
        _split_attn_kernel[(row_tiles, num_splits, B * Hkv)](
            q, k, v, kd, vd, lens, kt, vt, mask, out, lse, ws_o, ws_lse,
            *s3(q), *s3(k), *s3(v), *lens_strides, *tree_strides,
            M, N, Hkv, R, split_rows, num_splits, scale * _LOG2E,
            D=D, D_PAD=D_PAD, G=G, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TREE_BLOCK_N=tree_block_n,
            HAS_CACHE=has_cache, HAS_TREE=tree is not None, DIRECT_OUT=direct,
            DOT_PRECISION=_dot_precision(q.dtype), USE_TMA=use_tma, PDL=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if not direct:
        block_s, block_r = merge_tile(num_splits, R, D_PAD)
        _merge_splits_kernel[(_cdiv(R, block_r), B * Hkv)](
            ws_o, ws_lse, out, lse, M, Hkv, R, num_splits,
            D=D, D_PAD=D_PAD, G=G, BLOCK_R=block_r, BLOCK_S=block_s, PDL=pdl,
            num_warps=cfg.merge_num_warps, launch_pdl=pdl,
        )
    return out, lse


def _wgmma_applies(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, D: int, num_splits: int) -> bool:
    """Whether the Gluon sm_90 kernel takes this launch (see ``AttnConfig.wgmma``)."""
    return (q.device.type == "cuda" and _capability(q.device) == (9, 0) and q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == q.dtype and v.dtype == q.dtype and D in (64, 128) and lens.dim() == 1
            and num_splits >= 2 and tma_eligible(k) and tma_eligible(v))


def _launch_sm90(q, k, v, lens, kt, vt, mask, ws_o, ws_lse, strides, M, N, Hkv, R, G, D, split_rows, num_splits,
                 scale, cfg, has_tree):
    """The Gluon kernel's launch; ``strides`` = q's (batch, row, head), lens', then the tree K/V and mask strides
    in ``_split_attn_sm90_kernel``'s argument order."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from . import attention_sm90

    block = [1, cfg.block_n, 1, D]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16 if q.dtype == torch.float16 else gl.bfloat16)
    kd = GluonTensorDescriptor(k, list(k.shape), list(k.stride()), block, layout)
    vd = GluonTensorDescriptor(v, list(v.shape), list(v.stride()), block, layout)
    attention_sm90._split_attn_sm90_kernel[(_cdiv(R, cfg.block_m), num_splits, q.shape[0] * Hkv)](
        q, kd, vd, lens, kt, vt, mask, ws_o, ws_lse, *strides,
        M, N, Hkv, R, split_rows, num_splits, scale * _LOG2E,
        D=D, G=G, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, HAS_TREE=has_tree,
        num_warps=cfg.num_warps,
    )


def _reference_result(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    return out.contiguous(), lse.contiguous()


def tree_attn(
    q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, scale: float, *, config: Optional[AttnConfig] = None
) -> tuple[Tensor, Tensor]:
    """Masked attention among the M tree tokens.

    q ``[B, M, Hq, D]``, k/v ``[B, M, Hkv, D]`` (any strides, stride(-1) == 1), tree_mask bool ``[B, M, M]``.
    Returns out ``[B, M, Hq, D]`` (contiguous, q's dtype) and lse float32 ``[B, Hq, M]``. ``config`` overrides
    the table default (:func:`tree_config`).
    """
    if q.dtype == torch.float64:  # a debugging dtype: the fp32-accumulating kernels would lose its precision
        return _reference_result(*_ref.tree_attn(q, k, v, tree_mask, scale))
    cfg = config or tree_config(q.shape[3], q.shape[1] * (q.shape[2] // k.shape[2]), q.dtype)
    return _attention(q, None, (k, v, tree_mask), scale, cfg)


def prefix_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor, scale: float, *,
    config: Optional[AttnConfig] = None,
) -> tuple[Tensor, Tensor]:
    """Split-KV attention of q ``[B, M, Hq, D]`` over cache rows ``[0, kv_lens)`` of k/v_cache ``[B, N, Hkv, D]``.

    kv_lens int32/int64 ``[B]`` or ``[B, M]``; values are clamped into ``[0, N]`` on the device. Returns out
    ``[B, M, Hq, D]`` (contiguous, q's dtype) and lse float32 ``[B, Hq, M]``. ``config`` overrides the table default
    (:func:`split_config`); its ``split_rows`` forces the split size.
    """
    if q.dtype == torch.float64:
        lens = kv_lens.clamp(0, k_cache.shape[1])
        return _reference_result(*_ref.prefix_attn(q, k_cache, v_cache, lens, scale))
    cfg = config or split_config(q.shape[3], q.shape[1] * (q.shape[2] // k_cache.shape[2]), q.dtype, q.device)
    return _attention(q, (k_cache, v_cache, kv_lens), None, scale, cfg)


def hybrid_tree_attn(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    tree_mask: Tensor,
    scale: float,
    *,
    backend: HybridBackend = HybridBackend.FUSED,
    config: Optional[AttnConfig] = None,
    tree_config_override: Optional[AttnConfig] = None,
) -> tuple[Tensor, Tensor]:
    """One softmax over cache rows ``[0, cache_seqlens[b])`` plus the tree keys each ``tree_mask`` row allows.

    q ``[B, M, Hq, D]``; k/v_cache ``[B, N, Hkv, D]``; cache_seqlens ``[B]``; k/v_tree ``[B, M, Hkv, D]``;
    tree_mask bool ``[B, M, M]``. Returns out ``[B, M, Hq, D]`` (contiguous, q's dtype), lse float32 ``[B, Hq, M]``.

    ``backend=FUSED`` (default): the tree block joins the last split of the split-KV launch (two launches in all,
    one when the cache needs a single split).
    ``backend=COMPOSED``: prefix_attn, tree_attn and ``torch.ops.longspec.merge_attn_states``. ``config`` sets the
    split launch (FUSED, or the prefix launch of COMPOSED); ``tree_config_override`` the tree launch of COMPOSED.
    """
    if q.dtype == torch.float64:
        lens = cache_seqlens.clamp(0, k_cache.shape[1])
        return _reference_result(
            *_ref.hybrid_tree_attn(q, k_cache, v_cache, lens, k_tree, v_tree, tree_mask, scale))
    if backend is HybridBackend.COMPOSED:
        out_p, lse_p = prefix_attn(q, k_cache, v_cache, cache_seqlens, scale, config=config)
        out_t, lse_t = tree_attn(q, k_tree, v_tree, tree_mask, scale, config=tree_config_override)
        return torch.ops.longspec.merge_attn_states(out_p, lse_p, out_t, lse_t)
    if backend is not HybridBackend.FUSED:
        raise ValueError(f"hybrid_tree_attn: unknown backend {backend!r}")
    cfg = config or split_config(q.shape[3], q.shape[1] * (q.shape[2] // k_cache.shape[2]), q.dtype, q.device)
    return _attention(q, (k_cache, v_cache, cache_seqlens), (k_tree, v_tree, tree_mask), scale, cfg)


__all__ = [
    "AttnConfig",
    "HybridBackend",
    "hybrid_tree_attn",
    "plan_splits",
    "prefix_attn",
    "split_config",
    "tma_eligible",
    "tree_attn",
    "tree_config",
]
