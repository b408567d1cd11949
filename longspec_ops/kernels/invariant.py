"""Batch-invariant Triton kernels: a token's output row does not depend on how many rows share the launch.

Speculative verification computes a token's logits inside a forward of T tree tokens; plain decoding computes them
in a forward of one. With shape-dependent kernels (cuBLAS choosing tiles and split-K by M, PyTorch reductions
choosing a strategy by the row count, attention splitting the keys by the launch's size) the two round differently
and bf16 outputs part at near-ties. These kernels fix every reduction order independently of the launch's shape
(He et al., "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab, 2025):

* ``_linear_kernel`` (+ ``_split_k_sum_kernel``): ``y = x @ W^T (+ b)``, float32 accumulation, the K loop in
  order; a row's dot products never see another row. Narrow outputs split K into ``SPLIT_K`` fixed ranges (a count
  chosen from N, K and the device's SM count, never from M), each reduced in order into a float32 partial, and the
  partials are summed in ascending order by a second kernel (bias and the cast there): the same order for every M.
  The launch tile may follow M (:class:`LinearTile`): on tensor cores a row accumulates 16-element K steps in order
  whatever the tile, so the tile changes speed, not bits.
* ``_rms_norm_kernel``: one program per row, one block over the hidden size.
* ``_invariant_split_kernel`` + ``_invariant_merge_kernel``: split-KV attention whose splits start at fixed absolute
  key positions (multiples of ``split``) and whose blocks start at fixed offsets inside them, so key position p
  always lands in the same block and lane. Query m sees positions ``0 .. N + depth_m`` (N = committed rows); a
  position ``N + j`` reads cache row ``N + ancestors[m, j]`` (its depth-j ancestor's scratch row), so the key
  sequence is exactly the one plain decoding sees at that token after committing its ancestors (decode: M = 1,
  ancestors ``[[0]]``). A block whose keys are all committed rows is shared by every query of the tile (one
  ``tl.dot``); a block reaching past N is computed once per query with that query's keys by the *same* ``tl.dot``
  on the same tile shape, its rows selected afterwards. Both give a row the same bits (the dot is row-local), so a
  block's partial does not depend on whether decode or verify computed it, nor on which path. The splits of a row
  are merged ``merge_block_s`` at a time by one fixed-shape reduction, those steps in ascending order, by the same
  code for every launch; missing splits are exact no-ops.

Every size that differs between decode and verify (M, the rows of a tile, the committed length) is a runtime value,
never a constexpr, and is excluded from Triton's integer specialisation (``do_not_specialize``): a value of 1 would
otherwise compile a different kernel for decode.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention import _LN2, _merge_step, _row_tile


# Linear ---------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    X,  # (M, K) stride(-1) == 1
    W,  # (N, K) stride(-1) == 1
    BIAS,  # (N,)                          [HAS_BIAS and not SPLIT]
    Y,  # (M, N) contiguous, X's dtype; with SPLIT: float32 (SPLIT_K, M, N) partials
    M, N, K, K_SPLIT,
    stride_xm, stride_wn,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (pid, s) reduces K range [s * K_SPLIT, min((s + 1) * K_SPLIT, K)) in ascending BLOCK_K steps; K_SPLIT
    # is a multiple of BLOCK_K chosen from (N, K) only, so a row's partials never depend on M.
    # M tiles vary fastest: the programs that read one W tile run together, and its re-reads hit L2.
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + offs_k) < k_hi
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT:
        y_ptrs = Y + pid_s.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["MN"])
def _split_k_sum_kernel(
    WS,  # float32 (SPLIT_K, M, N) partials of _linear_kernel
    BIAS,  # (N,)                          [HAS_BIAS]
    Y,  # (M, N) contiguous
    MN, N, SPLIT_K,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    # Element-wise over the M * N outputs: partial 0, then + partial 1, + partial 2, ... in ascending order (float
    # adds are not reassociated), then + bias and one rounding to Y's dtype. No element sees another.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    ws_ptrs = WS + offs
    acc = tl.load(ws_ptrs, mask=ok, other=0.0)
    for _ in range(1, SPLIT_K):
        ws_ptrs += MN
        acc += tl.load(ws_ptrs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


# RMSNorm --------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    X,  # (R, H) stride(-1) == 1
    W,  # (H,)
    Y,  # (R, H) contiguous, promote(X, W) dtype
    H, stride_xr, eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(X + row * stride_xr + offs, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / H
    # As transformers' LlamaRMSNorm: normalise in float32, round to the input dtype, then scale by the weight.
    h = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(W + offs, mask=ok, other=0.0)
    y = w.to(tl.float32) * h.to(tl.float32)
    tl.store(Y + row * H + offs, y.to(Y.dtype.element_ty), mask=ok)


# Attention ------------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_weights(m_i, l_i, qk, qk_scale):
    """Online-softmax weights of one block of raw scores ``qk`` [BLOCK_M, BLOCK_N] (-inf where hidden): returns
    ``(p, alpha, m_new, l_new)``; the caller adds ``p @ V`` to ``acc * alpha``. Rows that saw nothing keep -inf."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk * qk_scale - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _key_rows(pos, n_commit, anc_base, depth, N):
    """Cache rows of key positions ``pos`` for one query (ancestors at ``anc_base``), and which it sees."""
    seen = pos <= n_commit + depth
    tree = pos >= n_commit
    off = tl.load(anc_base + (pos - n_commit), mask=tree & seen, other=0)
    rows = tl.where(tree, n_commit + off, pos)
    return tl.minimum(tl.maximum(rows, 0), N - 1), seen


@triton.jit(do_not_specialize=["M", "N", "R"])
def _invariant_split_kernel(
    Q,  # (B, M, Hq, D), stride(-1) == 1
    K, V,  # (B, N, Hkv, D) cache, stride(-1) == 1
    SEQLENS,  # (B,) int32 committed rows
    ANC,  # (B, M, A) int32 contiguous: ancestor offsets from SEQLENS[b]
    DEPTHS,  # (B, M) int32 contiguous
    WS_O,  # (B * Hkv, S, R, D) float32 partial outputs
    WS_LSE,  # (B * Hkv, S, R) float32 partial lse, log2 units
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    M, N, HKV, R, A, num_splits, qk_scale,
    D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr, QPT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Query tiles vary fastest (programs of one split share its K/V through L2), then (batch, kv head); splits go
    # last and from the top down, so the splits holding the tree (the longest programs: per-query blocks) start in
    # the first wave and the short ones fill in behind them. Which program computes a split changes no bit.
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    split = num_splits - 1 - tl.program_id(2)
    b = (bh // HKV).to(tl.int64)
    hk = bh % HKV

    slot = tl.arange(0, BLOCK_M)
    q_local = slot // G  # the tile's query of each row (QPT queries x G heads; rows past QPT * G are padding)
    m_r = pid_t * QPT + q_local
    row_ok = (slot < QPT * G) & (m_r < M)
    h_r = hk * G + slot % G
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)

    n_commit = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), N)
    depth_r = tl.load(DEPTHS + b * M + m_r, mask=row_ok, other=0)
    len_r = tl.where(row_ok, n_commit + depth_r + 1, 0)  # visible key positions [0, len_r)
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, tl.max(len_r, 0))
    if lo >= hi:
        return

    q = tl.load(Q + b * stride_qb + (m_r[:, None] * stride_qm + h_r[:, None] * stride_qh + offs_d[None, :]),
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    n_queries = tl.minimum(QPT, M - pid_t * QPT)

    # Blocks of committed rows only (n0 + BLOCK_N <= n_commit): the same keys for every query of the tile. A loop of
    # its own, without branches, so Triton pipelines its loads; every key is visible to every real row (padding
    # rows are never stored).
    committed_end = tl.minimum(hi, (n_commit // BLOCK_N) * BLOCK_N)
    for n0 in range(lo, committed_end, BLOCK_N):
        pos = n0 + offs_n
        k = tl.load(k_base + pos[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(v_base + pos[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, alpha, m_i, l_i = _softmax_weights(m_i, l_i, qk, qk_scale)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    # The blocks reaching past the committed rows: each query reads its own ancestors. One full-tile dot per query
    # (the same instruction on the same tile shape as above), keeping that query's rows.
    for n0 in range(tl.maximum(lo, committed_end), hi, BLOCK_N):
        pos = n0 + offs_n
        visible = pos[None, :] < len_r[:, None]
        qk = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
        for j in range(0, n_queries):
            m_j = pid_t * QPT + j
            depth_j = tl.load(DEPTHS + b * M + m_j)
            rows_j, seen_j = _key_rows(pos, n_commit, ANC + (b * M + m_j) * A, depth_j, N)
            k = tl.load(k_base + rows_j[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                        mask=seen_j[:, None] & d_ok[None, :], other=0.0)
            qk_j = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            qk = tl.where((q_local == j)[:, None], qk_j, qk)
        qk = tl.where(visible, qk, float("-inf"))
        p, alpha, m_i, l_i = _softmax_weights(m_i, l_i, qk, qk_scale)
        acc_in = acc * alpha[:, None]
        acc = acc_in
        for j in range(0, n_queries):
            m_j = pid_t * QPT + j
            depth_j = tl.load(DEPTHS + b * M + m_j)
            rows_j, seen_j = _key_rows(pos, n_commit, ANC + (b * M + m_j) * A, depth_j, N)
            v = tl.load(v_base + rows_j[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
                        mask=seen_j[:, None] & d_ok[None, :], other=0.0)
            acc_j = tl.dot(p.to(v.dtype), v, acc_in, input_precision=DOT_PRECISION)
            acc = tl.where((q_local == j)[:, None], acc_j, acc)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    rows = m_r * G + slot % G  # packed row (query, head of the group)
    ws = (bh.to(tl.int64) * num_splits + split) * R
    tl.store(WS_O + (ws + rows[:, None]) * D + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(WS_LSE + ws + rows, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["M", "N", "R"])
def _invariant_merge_kernel(
    WS_O,  # (B * Hkv, S, R, D) float32
    WS_LSE,  # (B * Hkv, S, R) float32, log2 units
    SEQLENS,  # (B,) int32
    DEPTHS,  # (B, M) int32
    OUT,  # (B, M, Hq, D) contiguous, Q's dtype
    LSE,  # (B, Hq, M) float32, natural log
    M, N, HKV, R, num_splits,
    D: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program (r, d, bh): BLOCK_R rows x BLOCK_D of the head dimension. A row's splits are merged BLOCK_S at a time
    # (chunk c holds splits [c * BLOCK_S, (c + 1) * BLOCK_S)), the chunks in ascending order; inside a chunk one
    # fixed-shape reduction. Splits past a row's last are exact no-ops (weight 0, scale 1), so a row's result
    # depends on its own splits only, never on its neighbours or on the launch.
    pid_d = tl.program_id(1)
    bh = tl.program_id(2)
    b, hk, rows, row_ok = _row_tile(tl.program_id(0), bh, HKV, R, BLOCK_R)
    m_r = rows // G
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_s = tl.arange(0, BLOCK_S)
    n_commit = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), N)
    depth_r = tl.load(DEPTHS + b * M + m_r, mask=row_ok, other=0)
    splits_r = tl.where(row_ok, tl.cdiv(n_commit + depth_r + 1, SPLIT), 0)
    ws = bh.to(tl.int64) * num_splits * R

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s0 in range(0, tl.max(splits_r, 0), BLOCK_S):
        s = s0 + offs_s
        ok = s[None, :] < splits_r[:, None]  # [R, S]
        cell = ws + s[None, :].to(tl.int64) * R + rows[:, None]  # [R, S]
        part = tl.load(WS_LSE + cell, mask=ok, other=float("-inf"))
        o = tl.load(WS_O + cell[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                    other=0.0)  # [R, S, BLOCK_D]
        m, acc, den = _merge_step(m, acc, den, part, o)
    seen = den > 0.0
    den_safe = tl.where(seen, den, 1.0)
    out = acc / den_safe[:, None]
    h_r = hk * G + rows % G
    out_ptrs = OUT + b * (M * HKV * G * D) + (m_r[:, None] * (HKV * G * D) + h_r[:, None] * D + offs_d[None, :])
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if pid_d == 0:
        lse = tl.where(seen, (tl.where(seen, m, 0.0) + tl.log2(den_safe)) * _LN2, float("-inf"))
        tl.store(LSE + b * (HKV * G * M) + h_r * M + m_r, lse, mask=row_ok)
