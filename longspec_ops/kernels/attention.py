"""Triton kernels for tree, prefix and hybrid tree attention: GQA-packed split-KV (flash-decoding) attention.

One kernel family serves the three ops:

* ``_split_attn_kernel`` computes one program's partial attention. A program owns one *row tile* of one
  ``(batch, kv head)`` pair: the tile's rows are ``(query m, head g of the GQA group)`` pairs (row ``r = m * G + g``),
  so every K/V block is loaded once per kv head and multiplied against all G query heads with one ``tl.dot``
  (FlashInfer's head-group fusion). It runs an online softmax (FlashAttention-2) over

  - the cache rows of its KV *split* (flash-decoding): split ``s`` covers rows ``[s * split_rows, (s+1) * split_rows)``
    intersected with each row's visible prefix ``[0, kv_len)``;
  - and/or, in the last split (after its cache rows), the MK tree keys under the bool ``[B, M, MK]`` tree mask (the
    paper's ``fused_mask_attn``; MK = M for a whole tree, MK > M for one level of a tree drafting over its nodes).

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

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_LOG2E = 1.4426950408889634  # the kernels work in log2 units: exp2 is the native SFU instruction
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # log2-unit lse -> natural log, inside the kernels


# Kernels --------------------------------------------------------------------------------------------------------
@triton.jit
def _row_tile(pid_r, bh, HKV, R, BLOCK: tl.constexpr):
    """Program ``(pid_r, bh)``'s batch row ``b`` (int64), kv head ``hk`` and packed rows ``[pid_r * BLOCK, ...)``
    with their in-range mask (rows ``r = m * G + g`` of one ``(batch, kv head)`` pair, R of them)."""
    rows = pid_r * BLOCK + tl.arange(0, BLOCK)
    return (bh // HKV).to(tl.int64), bh % HKV, rows, rows < R


@triton.jit
def _merge_step(m, acc, den, part_lse, o):
    """Fold one step of split partials into a running merge: ``part_lse`` [R, S] (log2 units, -inf = empty) and
    ``o`` [R, S, D] into the running max ``m`` [R], weighted sum ``acc`` [R, D] and weight total ``den`` [R]."""
    m_new = tl.maximum(m, tl.max(part_lse, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all partials empty so far: weights 0, not NaN
    alpha = tl.exp2(m - m_use)
    w = tl.exp2(part_lse - m_use[:, None])
    return m_new, acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1), den * alpha + tl.sum(w, 1)


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
    n_keys,  # MK in the last split, 0 elsewhere (the loop is then empty)
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
    KT, VT,  # (B, MK, Hkv, D) tree keys/values, stride(-1) == 1
    TMASK,  # (B, M, MK) uint8 view of the bool tree mask
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
    MK,  # tree keys (M for a whole tree; more for one level of a tree attending to all nodes so far)
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
    split = tl.program_id(1)
    bh = tl.program_id(2)
    b, hk, rows, row_ok = _row_tile(tl.program_id(0), bh, HKV, R, BLOCK_M)
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
        n_keys = tl.where(split == num_splits - 1, MK, 0)
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
    bh = tl.program_id(1)
    b, hk, rows, row_ok = _row_tile(tl.program_id(0), bh, HKV, R, BLOCK_R)
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
        m, acc, den = _merge_step(m, acc, den, part_lse, o)
    seen = den > 0.0
    den_safe = tl.where(seen, den, 1.0)
    out = acc / den_safe[:, None]
    lse = tl.where(seen, (tl.where(seen, m, 0.0) + tl.log2(den_safe)) * _LN2, float("-inf"))

    m_r = rows // G
    h_r = hk * G + rows % G
    out_ptrs = OUT + b * (M * HKV * G * D) + (m_r[:, None] * (HKV * G * D) + h_r[:, None] * D + offs_d[None, :])
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * (HKV * G * M) + h_r * M + m_r, lse, mask=row_ok)
