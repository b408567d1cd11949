"""Hopper (sm_90) split-KV attention in Gluon: TMA K/V ring, wgmma with Q and P in registers, softmax overlapped
with the previous block's P @ V (FlashAttention-3's intra-warpgroup pipelining).

It computes exactly what :func:`longspec_ops.kernels.attention._split_attn_kernel` computes for the shapes that
dominate verification cost (many packed rows over a long cache: compute bound), and writes the same float32
partials for the same split merge. One program = one warpgroup = a 64-row tile of one ``(batch, kv head)`` pair and
one KV split; the last split also takes the masked tree block. Why it exists: Triton 3.6 waits for each ``tl.dot``
right after issuing it, so a block's exponentials never run while a tensor-core op is in flight (the Triton kernel
reached 456 TFLOP/s of padded work at 32k on the H200). Here

* the scores of block j (``Q K_j^T``) and ``P_{j-1} V_{j-1}`` are issued back to back as async wgmma, the
  softmax of block j runs while ``P_{j-1} V_{j-1}`` is still in the tensor cores;
* 64-row tiles: the 296 packed rows of a 74-token tree at GQA group 4 cost 320 rows of work, not 384;
* two programs fit on one SM (3 stages of 64-row K and V blocks, 96 KiB), so one program's exponentials also
  overlap the other's matmuls.

Scope (the host picks this kernel only for it; everything else takes the Triton kernel): sm_90 exactly (wgmma),
fp16/bf16, head dims 64 and 128, one visible length per batch row (``cache_seqlens [B]``: hybrid tree attention and
batch-uniform prefix attention), TMA-eligible caches, at least two KV splits.

Measured (H200): hybrid tree attention at Llama-3-8B shapes 32.5 / 87.3 / 300.1 us at 8k / 32k / 128k
(benchmarks/results/h200/attention.md, 03440b6); the Triton kernel took 41.1 / 113.0 / 406.7 us in an earlier
comparison (paths.md, when this kernel took 32.3 / 92.2 / 317.5). Tested: numerics on the GPU only (Gluon has
no CPU interpreter; tests/ops/test_gpu_attention.py); register/shared-memory budget and the softmax/P @ V overlap in
the machine code offline on the CPU (tests/ops/test_sm90_kernel.py). compute-sanitizer on the H200 (this form, at
79b81d6): memcheck clean on 7 GPU tests, racecheck clean on 4 (README).

Reference: J. Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
arXiv:2407.08608 (producer/consumer asynchrony, intra-warpgroup softmax/GEMM overlap).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# A CTA-wide barrier: ``gl.thread_barrier`` in Triton 3.6, renamed ``gl.barrier`` by 3.8.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

BLOCK_M = gl.constexpr(64)  # one warpgroup's wgmma height
NUM_WARPS = gl.constexpr(4)


@gluon.constexpr_function
def _load_layout(D):
    # 16-byte vectors along D; the remaining lanes of a warp go down the rows.
    cols = min(32, D // 8)
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [NUM_WARPS, 1], [1, 0])


@gluon.jit
def _issue_kv(KD, VD, k_smem, v_smem, kv_bar, j, nb, b, hk, lo, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of K and V block ``j`` of this split into stage ``j % STAGES``, both completing one barrier
    (nothing when ``j >= nb``)."""
    s = j % STAGES
    pred = j < nb
    n0 = lo + j * BLOCK_N
    mbarrier.expect(kv_bar.index(s), KD.block_type.nbytes + VD.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(KD, [b, n0, hk, 0], kv_bar.index(s), k_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(VD, [b, n0, hk, 0], kv_bar.index(s), v_smem.index(s), pred=pred)


@gluon.jit
def _lane_split(x):
    """[BM, BN] in the wgmma accumulator layout -> [BM, BN // 8, 4, 2]: a thread holds columns 8j + 2 * lane + e of
    its rows (j < BN / 8, e < 2), the 4 lanes of a quad hold the rest. Reductions over axes 3 and 1 stay in-thread."""
    return x.reshape([x.shape[0], x.shape[1] // 8, 4, 2])


@gluon.jit
def _lane_sums(x):
    """Per-lane partial row sums of ``x`` ([BM, 4], one column per lane of the quad that holds a row)."""
    return gl.sum(gl.sum(_lane_split(x), 3), 1)


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, MASKED: gl.constexpr):
    """Online-softmax update in log2 units; returns (p, m_new, l_new, alpha). ``s`` holds raw scores (-inf where
    hidden). MASKED: a row may have seen nothing yet (m = -inf): subtract 0 there so exp2 gives 0, not NaN.
    The same update as ``attention._softmax_step`` (Triton), which a Gluon kernel cannot call: change both together.

    The kernel is bound by the latency of this chain (Nsight Compute on the H200: ~1.9 warps per scheduler, no
    eligible warp in 57% of cycles, mostly waiting on dependent arithmetic), so it is kept short: the row max is a
    shallow tree (column pairs, then 8 in-thread values, then the 4 lanes) instead of a 16-deep in-thread chain, and
    the row sums stay per lane (``l_i`` is [BM, 4]; the lanes are summed once, after the last block: the update is
    linear and alpha is per row), which takes two shuffles and two adds per row out of every block. Together: 90.0
    -> 86.5 us at 32k, 310 -> 298-305 us at 128k on the H200 (sm90_exploration.json, session6_softmax_chain)."""
    m_blk = gl.max(gl.max(gl.max(_lane_split(s), 3), 1), 1)
    m_new = gl.maximum(m_i, gl.convert_layout(m_blk, m_i.type.layout) * qk_scale)
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + _lane_sums(p)
    return p, m_new, l_i, alpha


# Lengths and split sizes vary per call (ragged batches, growing caches): not specialising on them keeps it to
# one compile per shape family (the engine's decode tests compile dozens of (M, N) buckets otherwise).
@gluon.jit(do_not_specialize=["M", "N", "HKV", "R", "split_rows", "num_splits"])
def _split_attn_sm90_kernel(
    Q,  # (B, M, Hq, D), stride(-1) == 1
    KD, VD,  # TMA descriptors of the (B, N, Hkv, D) caches, block [1, BLOCK_N, 1, D]
    LENS,  # (B,) visible cache rows per batch row (clamped into [0, N] here)
    KT, VT,  # (B, M, Hkv, D) tree keys/values, stride(-1) == 1          [HAS_TREE]
    TMASK,  # (B, M, M) uint8 view of the bool tree mask                  [HAS_TREE]
    WS_O,  # (B * Hkv, S, R, D) float32 partial outputs
    WS_LSE,  # (B * Hkv, S, R) float32 partial lse, log2 units
    stride_qb, stride_qm, stride_qh, stride_lb,
    stride_ktb, stride_ktm, stride_kth,
    stride_vtb, stride_vtm, stride_vth,
    stride_tb, stride_tm, stride_tn,
    M, N, HKV, R, split_rows, num_splits,
    qk_scale,  # softmax scale * log2(e)
    D: gl.constexpr, G: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_TREE: gl.constexpr,
):
    BM: gl.constexpr = BLOCK_M
    dtype: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    ld: gl.constexpr = _load_layout(D)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_r = gl.program_id(0)
    split = gl.program_id(1)
    bh = gl.program_id(2)
    b = bh // HKV
    hk = bh % HKV

    # Q tile -> registers in the wgmma A-operand layout (read once per program).
    rows_ld = pid_r * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
    d_ld = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    q_ptrs = (Q + b.to(gl.int64) * stride_qb
              + ((rows_ld // G)[:, None] * stride_qm + (hk * G + rows_ld % G)[:, None] * stride_qh + d_ld[None, :]))
    q = gl.load(q_ptrs, mask=(rows_ld < R)[:, None], other=0.0)
    q = gl.convert_layout(q, q_op)

    # K/V ring: STAGES buffers of [1, BLOCK_N, 1, D] (the descriptor's block), viewed as [BLOCK_N, D] for wgmma.
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, D], KD.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, D], VD.layout)
    l_pin = gl.allocate_shared_memory(gl.float32, [BM, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)

    n_b = gl.minimum(gl.maximum(gl.load(LENS + b * stride_lb), 0), N).to(gl.int32)
    lo = split * split_rows
    hi = gl.minimum(lo + split_rows, n_b)
    nb = gl.maximum(hi - lo + BLOCK_N - 1, 0) // BLOCK_N  # blocks of this split (the last may be partial)
    tail = hi - lo - (nb - 1) * BLOCK_N  # valid keys of the last block, in [1, BLOCK_N] when nb > 0

    for i in gl.static_range(STAGES):
        _issue_kv(KD, VD, k_smem, v_smem, kv_bar, i, nb, b, hk, lo, BLOCK_N, STAGES)

    acc = gl.zeros([BM, D], gl.float32, layout=o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=s_rows)
    l_i = _lane_sums(gl.zeros([BM, BLOCK_N], gl.float32, layout=s_layout))  # per-lane partial row sums
    s_zero = gl.zeros([BM, BLOCK_N], gl.float32, layout=s_layout)
    cols = gl.arange(0, BLOCK_N, layout=s_cols)

    if nb > 0:
        # Block 0: scores and softmax. Then, per block j: issue S_j = Q K_j^T, rescale O (alpha of block j-1) while
        # it runs, issue O += P_{j-1} V_{j-1}, take S_j, run its softmax while P_{j-1} V_{j-1} is in the tensor
        # cores, wait, and only then write P_j's registers (P @ V reads them from registers until the wait).
        mbarrier.wait(kv_bar.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False)
        s = gl.where((cols < tail)[None, :] | (nb > 1), s, float("-inf"))
        p32, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, False)
        p = gl.convert_layout(p32.to(dtype), p_op)
        for j in range(1, nb):
            st = j % STAGES
            sp = (j - 1) % STAGES
            mbarrier.wait(kv_bar.index(st), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q, k_smem.index(st).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            acc_tok = warpgroup_mma(p, v_smem.index(sp).reshape([BLOCK_N, D]), acc, is_async=True)
            # S_j is done once at most one group (P_{j-1} V_{j-1}) is in flight.
            s, q = warpgroup_mma_wait(1, deps=[s_tok, q])
            if j == nb - 1:
                s = gl.where((cols < tail)[None, :], s, float("-inf"))
            p32, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, False)
            # The wait has no data dependence on the softmax, and ptxas hoists it above the exponentials (no
            # overlap left) unless a memory write that needs them comes first: the row sums, to a scratch buffer
            # nobody reads. (P's registers are rewritten only after the wait: P_{j-1} V_{j-1} still reads them.)
            l_pin.store(l_i)
            acc, p = warpgroup_mma_wait(0, deps=[acc_tok, p])
            p = gl.convert_layout(p32.to(dtype), p_op)
            # Both operands of block j-1 are consumed: refill its stage with block j-1+STAGES.
            _issue_kv(KD, VD, k_smem, v_smem, kv_bar, j - 1 + STAGES, nb, b, hk, lo, BLOCK_N, STAGES)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        sl = (nb - 1) % STAGES
        v_last = v_smem.index(sl).reshape([BLOCK_N, D])
        if tail < BLOCK_N:
            # TMA loads whole blocks: rows past this split's keys may be unwritten cache capacity (NaN allowed),
            # and 0 * NaN = NaN, so zero them before the last P @ V.
            keep = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld)) < tail
            v_last.store(gl.where(keep[:, None], v_last.load(ld), 0.0))
            _cta_barrier()
            fence_async_shared()
        acc = warpgroup_mma(p, v_last, acc)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))

    rows_s = pid_r * BM + gl.arange(0, BM, layout=s_rows)
    if HAS_TREE:
        if split == num_splits - 1:
            # The tree keys, under the tree mask, through stage 0 of the ring (every TMA load has been consumed).
            _cta_barrier()
            kt_smem = k_smem.index(0).reshape([BLOCK_N, D])
            vt_smem = v_smem.index(0).reshape([BLOCK_N, D])
            m_s = rows_s // G
            row_ok = rows_s < R
            keys_ld = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
            kt_base = KT + b.to(gl.int64) * stride_ktb + hk * stride_kth
            vt_base = VT + b.to(gl.int64) * stride_vtb + hk * stride_vth
            mask_rows = TMASK + b.to(gl.int64) * stride_tb + m_s * stride_tm
            for j0 in range(0, M, BLOCK_N):
                key = j0 + keys_ld
                kt = gl.load(kt_base + key[:, None] * stride_ktm + d_ld[None, :], mask=(key < M)[:, None], other=0.0)
                vt = gl.load(vt_base + key[:, None] * stride_vtm + d_ld[None, :], mask=(key < M)[:, None], other=0.0)
                kt_smem.store(kt)
                vt_smem.store(vt)
                _cta_barrier()
                fence_async_shared()
                s = warpgroup_mma(q, kt_smem.permute((1, 0)), s_zero, use_acc=False)
                key_s = j0 + cols
                bits = gl.load(mask_rows[:, None] + key_s[None, :] * stride_tn,
                               mask=row_ok[:, None] & (key_s < M)[None, :], other=0)
                s = gl.where(bits != 0, s, float("-inf"))
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, True)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_op), vt_smem, acc)
                _cta_barrier()  # every warp is past this block's wgmma before the next block overwrites it

    # Empty rows (l = 0) have acc = 0: out 0, lse -inf (in log2 units, as the merge expects).
    l_i = gl.convert_layout(gl.sum(l_i, 1), s_rows)  # the lanes' partial row sums
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    lse2 = gl.where(seen, m_i + gl.log2(l_safe), float("-inf"))
    o = acc / gl.convert_layout(l_safe, o_rows)[:, None]
    ws = (bh.to(gl.int64) * num_splits + split) * R
    rows_o = pid_r * BM + gl.arange(0, BM, layout=o_rows)
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(WS_O + ws * D + (rows_o[:, None] * D + d_o[None, :]), o, mask=(rows_o < R)[:, None])
    gl.store(WS_LSE + ws + rows_s, lse2, mask=rows_s < R)
