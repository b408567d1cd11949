"""Triton kernels of ``beam_topk`` (see :mod:`longspec_ops.reference.beam` for the rule and the tie order).

A beam level in PyTorch is a float cast, a log-softmax and two ``topk`` calls: on an H200 at Llama-3-8B shapes
(16 parents x a 32k-token drafting vocabulary) PyTorch's radix select alone ran four to six kernels per call, ~50 us
of a ~400 us draft level (benchmarks/results/h200/draft_profile.txt). Here it is two launches, reading the logits
once in their own dtype:

1. ``_beam_chunk_kernel``, one program per (parent row, chunk of ``CHUNK`` columns): the chunk's max and sum of
   exponentials (the row's log-sum-exp, in pieces) and its top ``K1 = min(width, CHUNK)`` columns;
2. ``_beam_select_kernel``, one program per batch row: the rows' log-sum-exps, every candidate's score
   ``cum_logp[parent] + logit - lse[parent]``, and the top ``width`` candidates, best first.

Order keys are int64: the float's order in the high 32 bits, the reversed (parent, column) index in the low 32, so
every key is distinct, a max is a selection, and ties go to the lower pair exactly as in the reference. No atomics:
the result does not depend on scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOW = (1 << 32) - 1
_KEY_MIN = tl.constexpr(-(1 << 63))  # no candidate (a column past V, a slot past a chunk's valid columns)
# Chunks grow (up to _MAX_CHUNK columns) until a batch row has at most _TARGET_CANDIDATES candidates; the select
# kernel keeps up to _MAX_CANDIDATES_IN_REGISTERS int64 keys in registers (more loop through a scratch buffer).
# Both kernels are bound by their serial chains (K1, then WIDTH rounds of a 64-bit block max), so the warps are set
# for few values a thread: on the H200 (benchmarks/sweep_beam.py, results/h200/sweep_beam.md: 9 level shapes of the
# 69-node tree over 2k / 32k / 128k vocabularies, 20 calls a CUDA graph) 16 values a chunk thread and 8 keys a select
# thread took 135 us summed over the shapes, against 165 with 32 of each and 131 for each shape's own best plan.
# (One program per batch row for a whole small level, one launch, was slower from 4 parents up: 17 vs 12 us at
# 4 x 2048, 57 vs 13 at 16 x 2048.) The next step is fewer rounds, not more parallel ones.
_TARGET_CANDIDATES = 2048
_MAX_CANDIDATES_IN_REGISTERS = 4096
_MAX_CHUNK = 16384
_MIN_CHUNK = 512
_SELECT_BLOCK = 2048  # keys a step of the select kernel's looped path (candidates past its registers)
_CHUNK_PER_THREAD = 16  # values a thread of the chunk kernel
_SELECT_PER_THREAD = 8  # keys a thread of the select kernel


@triton.jit
def _order_key(x, index):
    """int64 key of float32 ``x``, ties to the lower ``index`` (int64 in [0, 2^32))."""
    bits = x.to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return order * 4294967296 + (4294967295 - index)


@triton.jit
def _key_value(key):
    """The float32 a key was made from."""
    order = (key >> 32).to(tl.int32)
    return tl.where(order < 0, order ^ 0x7FFFFFFF, order).to(tl.float32, bitcast=True)


@triton.jit
def _beam_chunk_kernel(
    LOGITS,  # (B, P, V), any float dtype, stride(-1) == 1
    stride_lb, stride_lp,
    STATS,  # (B * P, C, 2) float32: the chunk's max and sum of exp(x - max)
    CAND,  # (B * P, C, K1) int64 keys of the chunk's top K1 columns (index = column)
    P, V, C,
    K1: tl.constexpr, CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // P
    p = row % P
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(LOGITS + b.to(tl.int64) * stride_lb + p.to(tl.int64) * stride_lp + cols, mask=ok,
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.where(ok, tl.exp(x - m_use), 0.0), 0)
    st = STATS + (row.to(tl.int64) * C + chunk) * 2
    tl.store(st, m)
    tl.store(st + 1, s)
    key = tl.where(ok, _order_key(x, cols.to(tl.int64)), _KEY_MIN)
    out = CAND + (row.to(tl.int64) * C + chunk) * K1
    for i in range(K1):  # keys are distinct: the max is one column, removed for the next step
        top = tl.max(key, 0)
        tl.store(out + i, top)
        key = tl.where(key == top, _KEY_MIN, key)


@triton.jit
def _beam_select_kernel(
    STATS, CAND,  # the chunk kernel's outputs
    CUM,  # (B, P) float32 cumulative log-probabilities of the parents
    stride_cb,
    LSE,  # (B, P) float32 scratch: the rows' log-sum-exp
    KEYS,  # (B, NC) int64 scratch: every candidate's score key (when the candidates do not fit in registers)
    PARENT, COLUMN, SCORE,  # (B, WIDTH) int64, int64, float32
    P, V, C, NC,  # NC = P * C * K1 candidates per batch row
    WIDTH: tl.constexpr, K1: tl.constexpr, BLOCK_P: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK: tl.constexpr, IN_REGISTERS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    # 1. Each parent row's log-sum-exp from its chunks' (max, sum): BLOCK_P rows at a time.
    cs = tl.arange(0, C_PAD)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        ok = (ps < P)[:, None] & (cs < C)[None, :]
        st = STATS + ((b * P + ps[:, None]) * C + cs[None, :]) * 2
        m = tl.load(st, mask=ok, other=float("-inf"))
        s = tl.load(st + 1, mask=ok, other=0.0)
        big = tl.max(m, 1)
        big_use = tl.where(big == float("-inf"), 0.0, big)
        total = tl.sum(s * tl.exp(m - big_use[:, None]), 1)
        tl.store(LSE + b * P + ps, big_use + tl.log(tl.where(total > 0.0, total, 1.0)), mask=ps < P)
    tl.debug_barrier()  # the LSE rows written above are read back below by other threads of this program

    # 2. Score keys: cum[parent] + logit - lse[parent], ties to the lower (parent, column).
    per_parent = C * K1
    if IN_REGISTERS:
        keys = _score_keys(CAND, CUM, LSE, b, tl.arange(0, BLOCK), stride_cb, P, V, NC, per_parent)
        for i in range(WIDTH):
            top = tl.max(keys, 0)
            _store_choice(top, b, i, V, PARENT, COLUMN, SCORE, WIDTH)
            keys = tl.where(keys == top, _KEY_MIN, keys)
    else:
        for j0 in range(0, NC, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            tl.store(KEYS + b * NC + j, _score_keys(CAND, CUM, LSE, b, j, stride_cb, P, V, NC, per_parent), mask=j < NC)
        tl.debug_barrier()
        # 3. The next key below the last one chosen, WIDTH times (keys are distinct).
        last = tl.full([], 9223372036854775807, tl.int64)
        for i in range(WIDTH):
            best = tl.full([BLOCK], _KEY_MIN, tl.int64)
            for j0 in range(0, NC, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                k = tl.load(KEYS + b * NC + j, mask=j < NC, other=_KEY_MIN)
                best = tl.maximum(best, tl.where(k < last, k, _KEY_MIN))
            last = tl.max(best, 0)
            _store_choice(last, b, i, V, PARENT, COLUMN, SCORE, WIDTH)


@triton.jit
def _score_keys(CAND, CUM, LSE, b, j, stride_cb, P, V, NC, per_parent):
    """Score keys of candidates ``j`` of batch row ``b``: ``cum[parent] + logit - lse[parent]``, ties to the lower
    (parent, column); slots past NC or without a candidate get the minimum key."""
    ok = j < NC
    key1 = tl.load(CAND + b * NC + j, mask=ok, other=_KEY_MIN)
    valid = ok & (key1 != _KEY_MIN)
    parent = j // per_parent
    col = 4294967295 - (key1 & 4294967295)
    base = tl.load(CUM + b * stride_cb + parent, mask=valid, other=0.0) - tl.load(LSE + b * P + parent, mask=valid,
                                                                                     other=0.0)
    score = base + _key_value(key1)
    return tl.where(valid, _order_key(score, parent.to(tl.int64) * V + col), _KEY_MIN)


@triton.jit
def _store_choice(key, b, i, V, PARENT, COLUMN, SCORE, WIDTH: tl.constexpr):
    flat = 4294967295 - (key & 4294967295)
    tl.store(PARENT + b * WIDTH + i, flat // V)
    tl.store(COLUMN + b * WIDTH + i, flat % V)
    tl.store(SCORE + b * WIDTH + i, _key_value(key))


@dataclass(frozen=True)
class BeamPlan:
    """Launch parameters of one ``beam_topk`` call (exact for any values; they only move time).

    Attributes:
        chunk: columns per chunk program (a power of two).
        chunks: chunk programs per parent row (``cdiv(V, chunk)``).
        k1: candidates each chunk keeps (``min(width, V, chunk)``).
        chunk_warps, select_warps: ``num_warps`` of the two kernels.
    """

    chunk: int
    chunks: int
    k1: int
    chunk_warps: int
    select_warps: int

    def candidates(self, parents: int) -> int:
        """Candidates per batch row: what the select kernel reduces."""
        return parents * self.chunks * self.k1


def _warps(elements: int, per_thread: int) -> int:
    """Warps for a program reducing ``elements`` values, ``per_thread`` a thread: 1 to 16 warps."""
    return max(1, min(16, elements // (32 * per_thread)))


def plan(P: int, V: int, width: int, target_candidates: Optional[int] = None,
         chunk_per_thread: Optional[int] = None, select_per_thread: Optional[int] = None) -> BeamPlan:
    """The default :class:`BeamPlan` of a ``[B, P, V]`` level keeping ``width``: chunks sized so the ``P * C * K1``
    candidates of a batch row come near ``target_candidates`` (and fit the select kernel's registers where they
    can); warps so each thread holds about ``*_per_thread`` values. The keyword arguments are sweep knobs
    (``benchmarks/sweep_beam.py``); None takes the defaults."""
    target_candidates = target_candidates or _TARGET_CANDIDATES
    k1 = min(width, V)
    target = max(1, target_candidates // (P * k1))
    chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, triton.next_power_of_2(triton.cdiv(V, target))))
    k1 = min(k1, chunk)
    C = triton.cdiv(V, chunk)
    nc = P * C * k1
    block = triton.next_power_of_2(nc) if nc <= _MAX_CANDIDATES_IN_REGISTERS else _SELECT_BLOCK
    return BeamPlan(chunk=chunk, chunks=C, k1=k1, chunk_warps=_warps(chunk, chunk_per_thread or _CHUNK_PER_THREAD),
                    select_warps=_warps(block, select_per_thread or _SELECT_PER_THREAD))


def beam_topk(logits: Tensor, cum_logp: Tensor, width: int,
              beam_plan: Optional[BeamPlan] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Arguments as :func:`longspec_ops.reference.beam.beam_topk` (already checked); ``beam_plan`` overrides
    :func:`plan`'s default."""
    B, P, V = logits.shape
    dev = logits.device
    parent = torch.empty((B, width), dtype=torch.int64, device=dev)
    column = torch.empty((B, width), dtype=torch.int64, device=dev)
    score = torch.empty((B, width), dtype=torch.float32, device=dev)
    if B == 0:
        return parent, column, score
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cum = cum_logp if cum_logp.dtype == torch.float32 else cum_logp.float()
    if cum.stride(-1) != 1:
        cum = cum.contiguous()
    bp = beam_plan or plan(P, V, width)
    chunk, C, k1 = bp.chunk, bp.chunks, bp.k1
    NC = bp.candidates(P)
    stats = torch.empty((B * P, C, 2), dtype=torch.float32, device=dev)
    cand = torch.empty((B * P, C, k1), dtype=torch.int64, device=dev)
    lse = torch.empty((B, P), dtype=torch.float32, device=dev)
    in_registers = NC <= _MAX_CANDIDATES_IN_REGISTERS
    keys = cand if in_registers else torch.empty((B, NC), dtype=torch.int64, device=dev)  # unused in registers
    _beam_chunk_kernel[(B * P, C)](logits, logits.stride(0), logits.stride(1), stats, cand, P, V, C, K1=k1,
                                   CHUNK=chunk, num_warps=bp.chunk_warps)
    c_pad = triton.next_power_of_2(C)
    block = triton.next_power_of_2(NC) if in_registers else _SELECT_BLOCK
    _beam_select_kernel[(B,)](stats, cand, cum, cum.stride(0), lse, keys, parent, column, score, P, V, C, NC,
                              WIDTH=width, K1=k1, BLOCK_P=max(1, min(triton.next_power_of_2(P), 4096 // c_pad)),
                              C_PAD=c_pad, BLOCK=block, IN_REGISTERS=in_registers, num_warps=bp.select_warps)
    return parent, column, score
