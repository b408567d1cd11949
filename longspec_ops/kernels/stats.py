"""Triton kernel of ``record_acceptance_`` (see :mod:`longspec_ops.reference.stats` for what it computes).

An adaptive round's bookkeeping in PyTorch is ~25 small kernels (a scatter for the accepted path, two decays and
two ``index_add_``, an einsum, the running means); in a launch-bound round of a small target that was ~60 us of a
~1.2 ms round on the shipped pair. Here it is two launches and a memset: one program per block of nodes counts them
(atomics: several nodes may share a cell, as ``index_add_`` does on CUDA; scaled by ``1 / decay``, since the second
launch ages the whole table after them) and adds their share of every option's realised tau into a scratch sum; then
one program per block of cells ages the tables, and the first also updates the running means. (A single program
that walked every node in turn took 95 us at batch 16, slower than the PyTorch it replaces:
``benchmarks/results/h200/round_kernels_1prog.md``.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_C = 1024  # count cells per program
BLOCK_N = 64  # nodes per program


@triton.jit
def _record_nodes_kernel(proposed, accepted, tau_sum, keys, within, accept_index, accept_len, active, B, T, K, A,
                         cells, inv_decay, skb, skt, swb, swt, swk, sab, saj, B_P2: tl.constexpr, K_P2: tl.constexpr,
                         A_P2: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per BLOCK_N nodes: count them (scaled by 1 / decay: the next kernel ages the whole table, these
    adds included) and add their share of every option's realised tau into ``tau_sum``."""
    rb = tl.arange(0, B_P2)
    n_live = tl.sum((tl.load(active + rb, mask=rb < B, other=0) != 0).to(tl.float32), axis=0)
    k = tl.arange(0, K_P2)
    mk = k < K
    j = tl.arange(0, A_P2)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = n < B * T
    b = n // T
    t = n % T
    a = tl.load(active + b, mask=m, other=0) != 0
    length = tl.load(accept_len + b, mask=m, other=0)
    path = tl.load(accept_index + b[:, None] * sab + j[None, :] * saj,
                   mask=m[:, None] & (j[None, :] < length[:, None]) & (j[None, :] < A), other=-1)
    on = (tl.sum((path == t[:, None]).to(tl.int32), axis=1) > 0).to(tl.float32)
    w = tl.where(a & (t > 0), inv_decay, 0.0)
    key = tl.load(keys + b * skb + t * skt, mask=m, other=0)
    inside = m & (key >= 0) & (key < cells)  # the raw op reads no values: a bad cell is skipped, not written
    tl.atomic_add(proposed + key, w, mask=inside)
    tl.atomic_add(accepted + key, w * on, mask=inside)
    row_w = tl.where(a, 1.0 / tl.maximum(n_live, 1.0), 0.0)
    wk = tl.load(within + (b * swb + t * swt)[:, None] + k[None, :] * swk, mask=m[:, None] & mk[None, :], other=0.0)
    tl.atomic_add(tau_sum + k, tl.sum(wk * (on * row_w)[:, None], axis=0), mask=mk)


@triton.jit
def _record_finish_kernel(proposed, accepted, realised, mass, seen, contained, tau_sum, active, B, K, cells, decay,
                          rate, B_P2: tl.constexpr, K_P2: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per BLOCK_C cells ages the tables; program 0 also updates the running means."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < cells
    tl.store(proposed + c, tl.load(proposed + c, mask=m, other=0.0) * decay, mask=m)
    tl.store(accepted + c, tl.load(accepted + c, mask=m, other=0.0) * decay, mask=m)
    if tl.program_id(0) == 0:
        rb = tl.arange(0, B_P2)
        n_live = tl.sum((tl.load(active + rb, mask=rb < B, other=0) != 0).to(tl.float32), axis=0)
        k = tl.arange(0, K_P2)
        mk = k < K
        tau = tl.load(tau_sum + k, mask=mk, other=0.0)
        update = (tl.load(contained + k, mask=mk, other=0) != 0) & (tl.zeros([K_P2], tl.float32) + n_live > 0)
        ms = tl.load(mass + k, mask=mk, other=0.0) * tl.where(n_live > 0, 1.0 - rate, 1.0)
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
    cells = proposed.shape[0]
    B_P2, K_P2 = triton.next_power_of_2(max(B, 1)), triton.next_power_of_2(max(K, 1))
    tau_sum = torch.zeros(K_P2, dtype=torch.float32, device=proposed.device)
    _record_nodes_kernel[(max(1, triton.cdiv(B * T, BLOCK_N)),)](
        proposed, accepted, tau_sum, keys, within, accept_index, accept_len, active, B, T, K, A, cells, 1.0 / decay,
        *keys.stride(), *within.stride(), *accept_index.stride(), B_P2=B_P2, K_P2=K_P2,
        A_P2=triton.next_power_of_2(max(A, 1)), BLOCK_N=BLOCK_N, num_warps=4)
    _record_finish_kernel[(max(1, triton.cdiv(cells, BLOCK_C)),)](
        proposed, accepted, realised, mass, seen, contained, tau_sum, active, B, K, cells, decay, rate, B_P2=B_P2,
        K_P2=K_P2, BLOCK_C=BLOCK_C, num_warps=4)
