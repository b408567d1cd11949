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

Each kernel picks its top ``K`` keys one of two ways (:attr:`BeamPlan.chunk_select`, :attr:`BeamPlan.row_select`):

- ``SELECT_ROUNDS``: ``K`` rounds of a block-wide max, each removing the key it found. Every round is a reduction
  over the whole key vector (a shuffle tree, then shared memory and barriers across warps: ~0.3 us on the H200)
  that touches every key twice, so at width 16 both kernels are chains of 16 such steps.
- ``SELECT_THRESHOLD``: a fixed handful of block-wide steps, whatever ``K``. The keys are split into ``G`` groups;
  ``T``, the ``K``-th largest group maximum (ranked by counting: ``G x G`` compares), bounds the ``K``-th largest key
  from below, since ``K`` distinct groups each hold a key >= ``T``. So the top ``K`` are among the keys >= ``T`` (the
  survivors, counted in one reduction), which are few: ~18 of 4096 random logits at ``K`` 16, ``G`` 64. Then:

  * exactly ``K`` survivors: they are the maxima of the ``K`` best groups, and the count that found ``T`` already
    ranked them (~2/3 of random chunks at ``K`` 4, ``G`` 16; ~1/7 at ``K`` 16, ``G`` 64);
  * up to ``S``: a prefix sum compacts them into ``S`` scratch slots of the program, and each one's rank (its output
    slot) is the number of survivors above it (``S x S`` compares);
  * more than ``S`` (rows whose top values crowd into few groups): the rounds, so any input gives the exact result.

  Groups are strided columns in the chunk kernel (ties: the lowest columns fall in distinct groups, so a row of
  equal logits leaves exactly ``K`` survivors). In the select kernel, whose candidates are lists of ``K1`` sorted by
  logit, candidate (list ``L``, rank ``i``) is read into group ``(L + (G / K1) * i) mod G``, so the ranks of one list
  and the heads of ``G`` lists land in distinct groups: in a NumPy model of the 4-16-16 tree's levels (random
  logits; parents equal, or one far ahead) this left at most 36 survivors at ``G`` 64, where contiguous or strided
  groups left hundreds in one of the two cases.

  Counted in triton 3.6's sm_90 code (compiled without a GPU; time not measured on a GPU): at the 16 x 32768 level
  (8 warps in both kernels) the compacting path has 23 barriers and ~170 / ~80 shuffles (chunk / select kernel),
  the exactly-``K`` path 13 / 12 barriers, against 53 / 52 barriers and ~270 / ~260 shuffles for 16 rounds. At
  width 4 the rounds are few: one-warp chunk programs (no barriers either way) have 50 shuffles against 75-190, and
  the 4-warp select program of the 1 x 128256 level 18 barriers against 14-22. Which selection is faster where is
  for a GPU sweep to say (``_THRESHOLD_FROM_K`` sets the default).

  The chunk kernel's threshold path pairs its block-wide reductions: the chunk's max comes out of the threshold's
  reduction (a min of the kept group maxima beside a min of their complements), and the sum of exponentials out of
  the survivors' count (a float32 sum of both), with x recomputed from its key rather than held live. Its sm_90
  code (triton 3.6, all paths) went from 33 to 27 ``bar.sync`` and from 114 to 106 registers a thread at 8192
  columns on 16 warps (119 -> 120 at 4096 on 8; 16384 on 16 spills 80 bytes, was 48). Not yet timed on a GPU.
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
_KEY_FLOOR = tl.constexpr(-(1 << 63) + 1)  # the least key of a real candidate
_KEY_MAX = tl.constexpr((1 << 63) - 1)
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
# The threshold path holds the keys twice (its prefix sum and scatter run in another layout), so its chunk kernel
# stops at 16 keys a thread of 16 warps where the candidates still fit the select kernel's registers: with 32 (16384
# columns) triton 3.6's sm_90 code spilled ~400 bytes a thread.
_MAX_CHUNK_THRESHOLD = 8192
_MIN_CHUNK = 512
_SELECT_BLOCK = 2048  # keys a step of the select kernel's looped path (candidates past its registers)
_CHUNK_PER_THREAD = 16  # values a thread of the chunk kernel
_SELECT_PER_THREAD = 8  # keys a thread of the select kernel

SELECT_ROUNDS = 0  # K rounds of a block-wide max (the measured path)
SELECT_THRESHOLD = 1  # a threshold from group maxima, then ranks by counting among the survivors
# The threshold path's sizes grow with K (the counting compares are G x G and S x S); past this K the rounds are
# taken (a drafter's widths are 4 and 16).
_THRESHOLD_MAX_K = 64
# From which K (kept per program) the (chunk kernel, select kernel) take the threshold selection when plan() is not
# told: the one line to change once a GPU sweep (benchmarks/sweep_beam.py) has compared the two, e.g. (8, 8) for the
# threshold at width 16 and the rounds at width 4, (1, 1) for the threshold everywhere. Measured (H100,
# `sweep_beam --quick --select rounds threshold`, results/h100/sweep_beam.md): at width 16 the threshold took 8.9-11.8
# us a level against 12.1-20.2 for the rounds (27.2 vs 35.1 at 16 x 128256); at width 4 the rounds were as fast or
# faster (4.3 vs 5.8 us at 1 x 2048, 6.5 vs 6.9 at 1 x 32768, 7.5 vs 7.4 at 1 x 128256). Hence (8, 8).
_THRESHOLD_FROM_K = (8, 8)


def _threshold_sizes(k: int) -> tuple[int, int]:
    """(groups ``G``, survivor slots ``S``) of the threshold path for ``k`` keys kept: 4x the padded ``k``, at least
    16 (``G >= k`` is what makes ``T`` a bound; the rest is speed). In a NumPy model (random logits; the 4-16-16
    tree's levels with parents equal or one far ahead) 64 groups at k 16 left at most 36 survivors, 16 groups at k 4
    at most 11."""
    g = max(16, 4 * triton.next_power_of_2(k))
    return g, g


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
def _above(gmax, AXIS: tl.constexpr):
    """Per group, the number of groups with a larger maximum (``AXIS``: see :func:`_group_threshold`)."""
    if AXIS == 1:
        return tl.sum((gmax[None, :] > gmax[:, None]).to(tl.int32), 1)
    return tl.sum((gmax[:, None] > gmax[None, :]).to(tl.int32), 0)


@triton.jit
def _group_threshold(gmax, K: tl.constexpr, AXIS: tl.constexpr):
    """``(T, above)``: ``T`` the ``K``-th largest of the group maxima ``gmax``, ``above`` per group the number of
    groups with a larger maximum. ``K`` distinct groups hold a key >= ``T``, so the top ``K`` keys are all >= ``T``.
    Maxima are distinct keys but for groups with no candidate (the minimum key): fewer than ``K`` real maxima give
    ``T`` = the minimum key, and then every real key survives. ``AXIS`` only moves work: the ``G x G`` count is
    reduced along that axis, and which one stays inside a warp depends on the layout the kernel's reshape gave
    ``gmax`` (by the barriers and shuffles in triton 3.6's sm_90 code: 1 in the chunk kernel, 0 in the select
    kernel; the other way round gave 16 / 20 barriers instead of 13 / 12 at 16 x 32768)."""
    above = _above(gmax, AXIS)
    return tl.min(tl.where(above < K, gmax, _KEY_MAX), 0), above


@triton.jit
def _compact(keep, values, n, SCRATCH, S: tl.constexpr):
    """The ``n <= S`` ``values`` where ``keep``, compacted (a prefix sum) through ``SCRATCH`` (``S`` int64 slots of
    this program) into slots ``[0, n)`` of an ``S``-vector (the rest 0), and the mask of those slots."""
    pos = tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(SCRATCH + pos, values, mask=keep)
    tl.debug_barrier()  # the slots written above are read back below by other threads of this program
    j = tl.arange(0, S)
    ok = j < n
    return tl.load(SCRATCH + j, mask=ok, other=0), ok


@triton.jit
def _rank(keys):
    """Each key's rank: the number of larger keys (distinct keys: its slot in the descending order)."""
    return tl.sum((keys[:, None] > keys[None, :]).to(tl.int32), 0)


@triton.jit
def _chunk_rounds(key, out, K1: tl.constexpr):
    for i in range(K1):  # keys are distinct: the max is one column, removed for the next step
        top = tl.max(key, 0)
        tl.store(out + i, top)
        key = tl.where(key == top, _KEY_MIN, key)


@triton.jit
def _beam_chunk_kernel(
    LOGITS,  # (B, P, V), any float dtype, stride(-1) == 1
    stride_lb, stride_lp,
    STATS,  # (B * P, C, 2) float32: the chunk's max and sum of exp(x - max)
    CAND,  # (B * P, C, K1) int64 keys of the chunk's top K1 columns (index = column)
    SCRATCH,  # (B * P * C, S) int64: the threshold path's survivors (unused by the rounds)
    P, V, C,
    K1: tl.constexpr, CHUNK: tl.constexpr,
    SELECT: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // P
    p = row % P
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(LOGITS + b.to(tl.int64) * stride_lb + p.to(tl.int64) * stride_lp + cols, mask=ok,
                other=float("-inf")).to(tl.float32)
    key = tl.where(ok, _order_key(x, cols.to(tl.int64)), _KEY_MIN)
    st = STATS + (row.to(tl.int64) * C + chunk) * 2
    out = CAND + (row.to(tl.int64) * C + chunk) * K1
    if SELECT == 1:
        # Group g holds columns g, g + G, ...: the chunk's max is the largest group max (no pass over all keys),
        # found in one reduction with the threshold; the sum of exponentials and the survivors' count in another.
        gmax = tl.max(tl.reshape(key, [CHUNK // G, G]), 0)
        above = _above(gmax, 1)
        t, top = tl.split(tl.min(tl.join(tl.where(above < K1, gmax, _KEY_MAX), ~gmax), 0))  # ~: order reversed
        m = _key_value(~top)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        # x again from its key (a few integer ops) rather than held live across the threshold's reductions
        e = tl.where(ok, tl.exp(_key_value(key) - m_use), 0.0)
        s, n = tl.split(tl.sum(tl.join(e, (key >= tl.maximum(t, _KEY_FLOOR)).to(tl.float32)), 0))  # n < 2^24: exact
        n = n.to(tl.int32)
        tl.store(st, m)
        tl.store(st + 1, s)
        if (n == K1) & (t != _KEY_MIN):  # one survivor a group: the K1 best group maxima, ranked already
            tl.store(out + above, gmax, mask=above < K1)
        elif n <= S:
            scr = SCRATCH + (row.to(tl.int64) * C + chunk) * S
            sv, valid = _compact(key >= tl.maximum(t, _KEY_FLOOR), key, n, scr, S)
            sv = tl.where(valid, sv, _KEY_MIN)
            rank = _rank(sv)
            tl.store(out + rank, sv, mask=valid & (rank < K1))
            i = tl.arange(0, K1)
            tl.store(out + i, tl.full([K1], _KEY_MIN, tl.int64), mask=i >= n)  # fewer valid columns than K1
        else:
            _chunk_rounds(key, out, K1)
    else:
        m = tl.max(x, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        tl.store(st, m)
        tl.store(st + 1, tl.sum(tl.where(ok, tl.exp(x - m_use), 0.0), 0))
        _chunk_rounds(key, out, K1)


@triton.jit
def _grouped_order(q, G: tl.constexpr, K1: tl.constexpr):
    """The candidate read into register slot ``q`` of the threshold path (a permutation of ``[0, BLOCK)``, ``K1``
    dividing ``G``): slot ``q`` is in group ``q mod G``, and candidate ``(list L, rank i)`` lands in group
    ``(L + (G / K1) * i) mod G``. Inverse of that map within each run of ``G`` candidates (one run is ``G / K1``
    whole lists)."""
    r = q // G
    g = (q % G - r * (G // K1)) & (G - 1)
    return r * G + (g % (G // K1)) * K1 + g // (G // K1)


@triton.jit
def _beam_select_kernel(
    STATS, CAND,  # the chunk kernel's outputs
    CUM,  # (B, P) float32 cumulative log-probabilities of the parents
    stride_cb,
    LSE,  # (B, P) float32 scratch: the rows' log-sum-exp
    KEYS,  # (B, NC) int64 scratch: every candidate's score key (when the candidates do not fit in registers)
    SCRATCH,  # (B, S) int64: the threshold path's survivors
    PARENT, COLUMN, SCORE,  # (B, WIDTH) int64, int64, float32
    P, V, C, NC,  # NC = P * C * K1 candidates per batch row
    WIDTH: tl.constexpr, K1: tl.constexpr, BLOCK_P: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK: tl.constexpr, IN_REGISTERS: tl.constexpr,
    SELECT: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
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
        if SELECT == 1:
            q = tl.arange(0, BLOCK)
            if BLOCK <= S:  # few candidates: rank them all
                keys = _score_keys(CAND, CUM, LSE, b, q, stride_cb, P, V, NC, per_parent)
                rank = _rank(keys)
                _store_choices(keys, rank, (keys != _KEY_MIN) & (rank < WIDTH), b, V, PARENT, COLUMN, SCORE, WIDTH)
            else:
                keys = _score_keys(CAND, CUM, LSE, b, _grouped_order(q, G, K1), stride_cb, P, V, NC, per_parent)
                gmax = tl.max(tl.reshape(keys, [BLOCK // G, G]), 0)
                t, above = _group_threshold(gmax, WIDTH, 0)
                n = tl.sum((keys >= tl.maximum(t, _KEY_FLOOR)).to(tl.int32), 0)
                if (n == WIDTH) & (t != _KEY_MIN):  # one survivor a group: ranked already
                    _store_choices(gmax, above, above < WIDTH, b, V, PARENT, COLUMN, SCORE, WIDTH)
                elif n <= S:
                    sv, valid = _compact(keys >= tl.maximum(t, _KEY_FLOOR), keys, n, SCRATCH + b * S, S)
                    rank = _rank(tl.where(valid, sv, _KEY_MIN))
                    _store_choices(sv, rank, valid & (rank < WIDTH), b, V, PARENT, COLUMN, SCORE, WIDTH)
                else:
                    _select_rounds(keys, b, V, PARENT, COLUMN, SCORE, WIDTH)
        else:
            keys = _score_keys(CAND, CUM, LSE, b, tl.arange(0, BLOCK), stride_cb, P, V, NC, per_parent)
            _select_rounds(keys, b, V, PARENT, COLUMN, SCORE, WIDTH)
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
def _select_rounds(keys, b, V, PARENT, COLUMN, SCORE, WIDTH: tl.constexpr):
    for i in range(WIDTH):
        top = tl.max(keys, 0)
        _store_choice(top, b, i, V, PARENT, COLUMN, SCORE, WIDTH)
        keys = tl.where(keys == top, _KEY_MIN, keys)


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


@triton.jit
def _store_choices(key, i, mask, b, V, PARENT, COLUMN, SCORE, WIDTH: tl.constexpr):
    """:func:`_store_choice` of a vector of keys, each to its own slot ``i`` where ``mask``."""
    flat = 4294967295 - (key & 4294967295)
    tl.store(PARENT + b * WIDTH + i, flat // V, mask=mask)
    tl.store(COLUMN + b * WIDTH + i, flat % V, mask=mask)
    tl.store(SCORE + b * WIDTH + i, _key_value(key), mask=mask)


@dataclass(frozen=True)
class BeamPlan:
    """Launch parameters of one ``beam_topk`` call (exact for any values; they only move time).

    Attributes:
        chunk: columns per chunk program (a power of two).
        chunks: chunk programs per parent row (``cdiv(V, chunk)``).
        k1: candidates each chunk keeps (``min(width, V, chunk)``; rounded up to a power of two where a kernel takes
            the threshold selection: the extra slots hold the next columns, or no candidate).
        chunk_warps, select_warps: ``num_warps`` of the two kernels.
        chunk_select, row_select: how the chunk kernel and the select kernel pick their top keys, ``SELECT_ROUNDS``
            or ``SELECT_THRESHOLD`` (module docstring). The select kernel takes the rounds wherever its candidates
            do not fit its registers.
        select_block: keys the select program holds in registers (a power of two, at least the candidates), or 0:
            the candidates loop through a scratch buffer, ``_SELECT_BLOCK`` at a time (the rounds).
    """

    chunk: int
    chunks: int
    k1: int
    chunk_warps: int
    select_warps: int
    chunk_select: int = SELECT_ROUNDS
    row_select: int = SELECT_ROUNDS
    select_block: int = 0

    def candidates(self, parents: int) -> int:
        """Candidates per batch row: what the select kernel reduces."""
        return parents * self.chunks * self.k1


def _warps(elements: int, per_thread: int) -> int:
    """Warps for a program reducing ``elements`` values, ``per_thread`` a thread: 1 to 16 warps."""
    return max(1, min(16, elements // (32 * per_thread)))


def plan(P: int, V: int, width: int, target_candidates: Optional[int] = None,
         chunk_per_thread: Optional[int] = None, select_per_thread: Optional[int] = None,
         chunk_select: Optional[int] = None, row_select: Optional[int] = None,
         max_in_registers: Optional[int] = None) -> BeamPlan:
    """The default :class:`BeamPlan` of a ``[B, P, V]`` level keeping ``width``: chunks sized so the ``P * C * K1``
    candidates of a batch row come near ``target_candidates`` (and fit the select kernel's registers where they
    can); warps so each thread holds about ``*_per_thread`` values; each kernel's selection by ``_THRESHOLD_FROM_K``
    (both take the rounds past ``_THRESHOLD_MAX_K`` kept); the select kernel's candidates in its registers up to
    ``max_in_registers``. The keyword arguments are sweep knobs (``benchmarks/sweep_beam.py``); None takes the
    defaults."""
    target_candidates = target_candidates or _TARGET_CANDIDATES
    cap = max_in_registers or _MAX_CANDIDATES_IN_REGISTERS
    by_k = [SELECT_THRESHOLD if k >= k0 else SELECT_ROUNDS for k, k0 in zip((min(width, V), width), _THRESHOLD_FROM_K)]
    selects = (by_k[0] if chunk_select is None else chunk_select, by_k[1] if row_select is None else row_select)
    if any(sel not in (SELECT_ROUNDS, SELECT_THRESHOLD) for sel in selects):
        raise ValueError(f"unknown beam selection in {selects}")
    if triton.next_power_of_2(width) > _THRESHOLD_MAX_K:
        selects = (SELECT_ROUNDS, SELECT_ROUNDS)
    k1 = min(width, V)
    target = max(1, target_candidates // (P * k1))
    chunk = min(_MAX_CHUNK, max(_MIN_CHUNK, triton.next_power_of_2(triton.cdiv(V, target))))
    k1 = min(k1, chunk)
    if SELECT_THRESHOLD in selects:
        k1 = triton.next_power_of_2(k1)  # <= chunk; lists of K1 divide the select kernel's groups
    if (selects[0] == SELECT_THRESHOLD and chunk > _MAX_CHUNK_THRESHOLD
            and P * triton.cdiv(V, _MAX_CHUNK_THRESHOLD) * k1 <= cap):
        chunk = _MAX_CHUNK_THRESHOLD  # unless the select kernel would lose its registers (16 x 151936: 4864)
    C = triton.cdiv(V, chunk)
    nc = P * C * k1
    block = triton.next_power_of_2(nc) if nc <= cap else 0
    return BeamPlan(chunk=chunk, chunks=C, k1=k1, chunk_warps=_warps(chunk, chunk_per_thread or _CHUNK_PER_THREAD),
                    select_warps=_warps(block or _SELECT_BLOCK, select_per_thread or _SELECT_PER_THREAD),
                    chunk_select=selects[0], row_select=selects[1], select_block=block)


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
    in_registers = bp.select_block > 0
    if in_registers and (bp.select_block < NC or bp.select_block & (bp.select_block - 1)):
        raise ValueError(f"{bp}: select_block must be a power of two >= the {NC} candidates (or 0)")
    chunk_select = bp.chunk_select
    row_select = bp.row_select if in_registers else SELECT_ROUNDS
    if SELECT_THRESHOLD in (chunk_select, row_select) and (
            k1 & (k1 - 1) or triton.next_power_of_2(width) > _THRESHOLD_MAX_K):
        raise ValueError(f"{bp}: the threshold selection needs a power-of-two k1 and width <= {_THRESHOLD_MAX_K}")
    stats = torch.empty((B * P, C, 2), dtype=torch.float32, device=dev)
    cand = torch.empty((B * P, C, k1), dtype=torch.int64, device=dev)
    lse = torch.empty((B, P), dtype=torch.float32, device=dev)
    keys = cand if in_registers else torch.empty((B, NC), dtype=torch.int64, device=dev)  # unused in registers
    g1, s1 = _threshold_sizes(k1)  # groups and survivor slots of each kernel's threshold path
    g2, s2 = _threshold_sizes(width)
    # Survivor slots, one row a program (a dummy where the kernel takes the rounds).
    chunk_scratch = (torch.empty((B * P * C, s1), dtype=torch.int64, device=dev)
                     if chunk_select == SELECT_THRESHOLD else cand)
    row_scratch = torch.empty((B, s2), dtype=torch.int64, device=dev) if row_select == SELECT_THRESHOLD else cand
    _beam_chunk_kernel[(B * P, C)](logits, logits.stride(0), logits.stride(1), stats, cand, chunk_scratch, P, V, C,
                                   K1=k1, CHUNK=chunk, SELECT=chunk_select, G=g1, S=s1, num_warps=bp.chunk_warps)
    c_pad = triton.next_power_of_2(C)
    block = bp.select_block if in_registers else _SELECT_BLOCK
    _beam_select_kernel[(B,)](stats, cand, cum, cum.stride(0), lse, keys, row_scratch, parent, column, score,
                              P, V, C, NC, WIDTH=width, K1=k1,
                              BLOCK_P=max(1, min(triton.next_power_of_2(P), 4096 // c_pad)), C_PAD=c_pad, BLOCK=block,
                              IN_REGISTERS=in_registers, SELECT=row_select, G=g2, S=s2, num_warps=bp.select_warps)
    return parent, column, score
