"""Triton kernel of ``record_acceptance_`` (see :mod:`longspec_ops.reference.stats` for what it computes).

An adaptive round's bookkeeping in PyTorch is ~25 small kernels (a scatter for the accepted path, two decays and
two ``index_add_``, an einsum, the running means); in a launch-bound round of a small target that was ~60 us of a
~1.2 ms round on the shipped pair. Here it is one program: it ages the count tables, then adds the round's nodes
(atomics: several nodes may share a cell, as ``index_add_`` does on CUDA), sums each option's realised tau over the
nodes and updates the running means.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK_C = 1024  # count cells per step
BLOCK_N = 64  # nodes per step


@triton.jit
def _record_kernel(proposed, accepted, realised, mass, seen, keys, within, contained, accept_index, accept_len,
                   active, B, T, K, A, cells, decay, rate, skb, skt, swb, swt, swk, sab, saj,
                   B_P2: tl.constexpr, K_P2: tl.constexpr, A_P2: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    rb = tl.arange(0, B_P2)
    live = (tl.load(active + rb, mask=rb < B, other=0) != 0).to(tl.float32)
    n_live = tl.sum(live, axis=0)
    any_live = n_live > 0
    for lo in range(0, cells, BLOCK_C):
        c = lo + tl.arange(0, BLOCK_C)
        m = c < cells
        tl.store(proposed + c, tl.load(proposed + c, mask=m, other=0.0) * decay, mask=m)
        tl.store(accepted + c, tl.load(accepted + c, mask=m, other=0.0) * decay, mask=m)
    tl.debug_barrier()  # the aged counts before the round's adds
    k = tl.arange(0, K_P2)
    mk = k < K
    j = tl.arange(0, A_P2)
    tau = tl.zeros([K_P2], dtype=tl.float32)
    for lo in range(0, B * T, BLOCK_N):
        n = lo + tl.arange(0, BLOCK_N)
        m = n < B * T
        b = n // T
        t = n % T
        a = tl.load(active + b, mask=m, other=0) != 0
        length = tl.load(accept_len + b, mask=m, other=0)
        path = tl.load(accept_index + b[:, None] * sab + j[None, :] * saj,
                       mask=m[:, None] & (j[None, :] < length[:, None]) & (j[None, :] < A), other=-1)
        on = (tl.sum((path == t[:, None]).to(tl.int32), axis=1) > 0).to(tl.float32)
        w = tl.where(a & (t > 0), 1.0, 0.0)
        key = tl.load(keys + b * skb + t * skt, mask=m, other=0)
        inside = m & (key >= 0) & (key < cells)  # the raw op reads no values: a bad cell is skipped, not written
        tl.atomic_add(proposed + key, w, mask=inside)
        tl.atomic_add(accepted + key, w * on, mask=inside)
        row_w = tl.where(a, 1.0 / tl.maximum(n_live, 1.0), 0.0)
        wk = tl.load(within + (b * swb + t * swt)[:, None] + k[None, :] * swk, mask=m[:, None] & mk[None, :],
                     other=0.0)
        tau += tl.sum(wk * (on * row_w)[:, None], axis=0)
    update = (tl.load(contained + k, mask=mk, other=0) != 0) & (tl.zeros([K_P2], tl.float32) + n_live > 0)
    ms = tl.load(mass + k, mask=mk, other=0.0) * tl.where(any_live, 1.0 - rate, 1.0)
    w = tl.where(update, rate, 0.0)
    r = tl.load(realised + k, mask=mk, other=0.0)
    tl.store(realised + k, r + (tau - r) * (w / tl.maximum(ms + w, 1e-12)), mask=mk)
    tl.store(mass + k, ms + w, mask=mk)
    was = tl.load(seen + k, mask=mk, other=0) != 0
    tl.store(seen + k, (was | update).to(tl.int1), mask=mk)


def record_acceptance_(proposed: Tensor, accepted: Tensor, realised: Tensor, mass: Tensor, seen: Tensor,
                       keys: Tensor, within: Tensor, contained: Tensor, accept_index: Tensor, accept_len: Tensor,
                       active: Tensor, decay: float, rate: float) -> None:
    """Arguments as :func:`longspec_ops.reference.stats.record_acceptance_` (already checked; the state tensors
    contiguous, the round's inputs any strides)."""
    B, T = keys.shape
    K, A = realised.shape[0], accept_index.shape[1]
    _record_kernel[(1,)](proposed, accepted, realised, mass, seen, keys, within, contained, accept_index,
                         accept_len, active, B, T, K, A, proposed.shape[0], decay, rate, *keys.stride(),
                         *within.stride(), *accept_index.stride(),
                         B_P2=triton.next_power_of_2(max(B, 1)), K_P2=triton.next_power_of_2(max(K, 1)),
                         A_P2=triton.next_power_of_2(max(A, 1)), BLOCK_C=BLOCK_C, BLOCK_N=BLOCK_N, num_warps=4)
