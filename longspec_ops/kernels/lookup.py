"""Triton kernels of ``prompt_lookup_chain`` (see :mod:`longspec_ops.reference.lookup` for the rule).

Prompt lookup's matching in PyTorch is ~60 kernels (an ``unfold``, a compare, a reduction and a max per n-gram
size, a top-k, gathers); a round of a small target is launch-bound, so on the shipped pair that was ~200 us of a
~1.1 ms round. Here it is two launches:

1. ``_lookup_partial_kernel``, one program per (row, chunk of ``CHUNK`` candidate window ends): each block of ends
   compares its window's tokens against the n tokens ending at the root (n = 1 .. max_ngram, a longer match
   overriding a shorter one) and the chunk's best score ``n * (C + 1) + start`` goes to a ``[B, chunks]`` buffer;
2. ``_lookup_chain_kernel``, one program per row: the best over the chunks picks the start, and the continuation
   (with the period rule) is stored with the root in front.

No atomics, so the result does not depend on scheduling; chunks spread a 128k-token row over 32 programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # window ends per step of a program
CHUNK = 4096  # window ends per program (a multiple of BLOCK)


@triton.jit
def _lookup_partial_kernel(tok_ptr, stride_b, seqlens_ptr, part_ptr, C, S,
                           CHUNK: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tok_ptr + b.to(tl.int64) * stride_b
    # the root's column, clamped into the row: a bad length never reads outside it (the raw op reads no values)
    last = tl.maximum(tl.minimum(tl.load(seqlens_ptr + b).to(tl.int64), C - 1), 0)
    best = tl.full([BLOCK], -1, tl.int64)
    for lo in tl.static_range(0, CHUNK, BLOCK):
        e = chunk.to(tl.int64) * CHUNK + lo + tl.arange(0, BLOCK)  # the window's last column; a start is e + 1
        alive = e < last
        for k in tl.static_range(MAX_N):
            want = tl.load(row + tl.maximum(last - k, 0))
            got = tl.load(row + e - k, mask=alive & (e >= k), other=0)
            alive = alive & (e >= k) & (last >= k) & (got == want)
            if k + 1 >= MIN_N:
                best = tl.maximum(best, tl.where(alive, (k + 1) * (C + 1) + e + 1, -1))
    tl.store(part_ptr + b.to(tl.int64) * S + chunk, tl.max(best, axis=0))


@triton.jit
def _lookup_chain_kernel(tok_ptr, stride_b, seqlens_ptr, part_ptr, out_ptr, found_ptr, C, S,
                         DEPTH: tl.constexpr, DEPTH_P2: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    row = tok_ptr + b.to(tl.int64) * stride_b
    last = tl.maximum(tl.minimum(tl.load(seqlens_ptr + b).to(tl.int64), C - 1), 0)
    best = tl.full([BLOCK_S], -1, tl.int64)
    for lo in range(0, S, BLOCK_S):
        i = lo + tl.arange(0, BLOCK_S)
        best = tl.maximum(best, tl.load(part_ptr + b.to(tl.int64) * S + i, mask=i < S, other=-1))
    top = tl.max(best, axis=0)
    found = top >= 0
    start = tl.where(found, top % (C + 1), last)
    period = tl.maximum(last + 1 - start, 1)
    d = tl.arange(0, DEPTH_P2).to(tl.int64)
    root = tl.load(row + last)
    cont = tl.load(row + start + d % period, mask=(d < DEPTH) & found, other=0)
    out = out_ptr + b.to(tl.int64) * (DEPTH + 1)
    tl.store(out, root)
    tl.store(out + 1 + d, tl.where(found, cont, root), mask=d < DEPTH)
    tl.store(found_ptr + b, found)


def prompt_lookup_chain(tokens: Tensor, seqlens: Tensor, depth: int, min_ngram: int,
                        max_ngram: int) -> tuple[Tensor, Tensor]:
    """Arguments as :func:`longspec_ops.reference.lookup.prompt_lookup_chain` (already checked)."""
    B, C = tokens.shape
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    chain = torch.empty((B, depth + 1), dtype=torch.int64, device=tokens.device)
    found = torch.empty((B,), dtype=torch.bool, device=tokens.device)
    if B:
        S = triton.cdiv(C, CHUNK)
        part = torch.empty((B, S), dtype=torch.int64, device=tokens.device)
        _lookup_partial_kernel[(B, S)](tokens, tokens.stride(0), seqlens, part, C, S, CHUNK=CHUNK, MIN_N=min_ngram,
                                       MAX_N=max_ngram, BLOCK=BLOCK, num_warps=4)
        _lookup_chain_kernel[(B,)](tokens, tokens.stride(0), seqlens, part, chain, found, C, S, DEPTH=depth,
                                   DEPTH_P2=triton.next_power_of_2(max(depth, 1)),
                                   BLOCK_S=min(triton.next_power_of_2(S), 1024), num_warps=4)
    return chain, found
