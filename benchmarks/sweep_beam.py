"""Sweep ``beam_topk``'s launch plan on the GPU at the draft levels' shapes (bf16 logits, B 1).

Each plan (:class:`longspec_ops.kernels.beam.BeamPlan`: candidates per batch row, values per thread of the chunk
and the select kernel, and each kernel's selection: the rounds or the threshold) is timed as the drafter runs it: 20
calls in one CUDA graph, logits warm in L2 (the LM head has just written them), the median of 5 replays per call.
Every plan must pick the reference's pairs. Prints per shape the default's time and the fastest plans of each
selection; writes ``sweep_beam.json`` / ``.md`` (column ``select`` names the selection). Usage (GPU):
``python -m benchmarks.sweep_beam [--out DIR] [--select NAME ...]`` (the four selections double the compiles of the
two the previous sweep had: ``--select`` splits a run). Besides the rule's plans, each threshold plan is also timed
with 16384-column chunks on 32 and on 16 warps (``_wide_chunk_plans``), and full-vocabulary levels with up to 8192
candidates in the select program's registers (``_small_chunk_plans``): plans the rule does not make.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.harness import write_results
from benchmarks.timing import graph_calls_us
from longspec_ops.kernels import beam as K
from longspec_ops.reference import beam as ref

# (parents, vocabulary, width): the 4-16-16-16-16 tree's levels over the shipped pair's 2048-token drafting
# vocabulary, a 32k drafting vocabulary and Llama-3's full 128,256, and the 4-12-12-12-12 tree's levels over the full
# vocabulary (where the step's profile put the chunk kernel at 20.3 us for 12 parents: results/h200/NOTES.md).
SHAPES = ([(P, V, w) for V in (2048, 32768, 128256) for P, w in ((1, 4), (4, 16), (16, 16))]
          + [(4, 128256, 12), (12, 128256, 12)])
TARGETS = (512, 1024, 2048, 4096)
CHUNK_PER_THREAD = (4, 8, 16, 32)
SELECT_PER_THREAD = (2, 4, 8, 32)
# (chunk kernel, select kernel) selections by name.
SELECTS = {
    "rounds": (K.SELECT_ROUNDS, K.SELECT_ROUNDS),
    "threshold": (K.SELECT_THRESHOLD, K.SELECT_THRESHOLD),
    "threshold-chunk": (K.SELECT_THRESHOLD, K.SELECT_ROUNDS),
    "threshold-select": (K.SELECT_ROUNDS, K.SELECT_THRESHOLD),
}


def _name(bp: K.BeamPlan) -> str:
    return next(n for n, s in SELECTS.items() if s == (bp.chunk_select, bp.row_select))


def _wide_chunk_plans(P: int, V: int, like: K.BeamPlan) -> list[K.BeamPlan]:
    """``like``'s selections with the chunk kernel on 16384 columns, of 32 warps (16 keys a thread, as 8192 on 16)
    and of 16 (32 keys a thread): plans the rule does not make (it caps threshold chunks at 8192 columns), so that a
    full-vocabulary level of 12-16 parents is 96-128 programs, one wave, not 192-256. Triton 3.6's sm_90a code
    (its own ptxas, compiled on a CPU) gives the 8192-column, 16-warp chunk program 106 registers a thread, no
    spills (one program an SM: the 192 programs of 12 x 128256 are 1.5 waves); 16384 columns spill 224 bytes a
    thread on 32 warps (64 registers at most) and 80 on 16. Empty where they do not apply."""
    if like.chunk_select != K.SELECT_THRESHOLD or V <= K._MAX_CHUNK_THRESHOLD:
        return []
    chunk = 2 * K._MAX_CHUNK_THRESHOLD
    C = -(-V // chunk)
    nc = P * C * like.k1
    block = 1 << (nc - 1).bit_length() if nc <= K._MAX_CANDIDATES_IN_REGISTERS else 0
    return [K.BeamPlan(chunk, C, like.k1, warps, K._warps(block or K._SELECT_BLOCK, K._SELECT_PER_THREAD),
                       like.chunk_select, like.row_select, block) for warps in (32, 16)]


def _small_chunk_plans(P: int, V: int, w: int, select: tuple[int, int]) -> list[K.BeamPlan]:
    """Plans with up to 8192 candidates in the select program's registers (16 warps; triton 3.6's sm_90 code: 97
    registers a thread, no spills), so that 4096-column chunks of 8 warps (120 registers: two programs an SM) can
    cover a full-vocabulary level: 384 programs at 12 x 128256. The rule keeps 4096 (the looped select path past)."""
    if V <= K._MAX_CHUNK_THRESHOLD:
        return []
    return [K.plan(P, V, w, target_candidates=t, chunk_select=select[0], row_select=select[1], max_in_registers=8192)
            for t in (4096, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--select", nargs="+", choices=list(SELECTS), default=list(SELECTS),
                    help="selections to time (default: all four)")
    ap.add_argument("--quick", action="store_true",
                    help="each selection at the default knobs only (one plan per selection and shape)")
    ap.add_argument("--vocabs", type=int, nargs="+", default=None, help="only the shapes of these vocabularies")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for P, V, w in SHAPES:
        if a.vocabs and V not in a.vocabs:
            continue
        logits = (torch.randn(1, P, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
        cum = torch.randn(1, P, device="cuda", generator=g)
        want = ref.beam_topk(logits.cpu(), cum.cpu(), w)
        default = K.plan(P, V, w)
        seen = {}
        plans = [default] + [K.plan(P, V, w, target_candidates=t, chunk_per_thread=cpt, select_per_thread=spt,
                                    chunk_select=SELECTS[s][0], row_select=SELECTS[s][1])
                             for s in a.select
                             for t, cpt, spt in (itertools.product(TARGETS, CHUNK_PER_THREAD, SELECT_PER_THREAD)
                                                 if not a.quick else [(None, None, None)])]
        plans += [wide for bp in list(plans) for wide in _wide_chunk_plans(P, V, bp)]
        plans += [bp for s in a.select for bp in _small_chunk_plans(P, V, w, SELECTS[s])]
        for bp in plans:
            if bp in seen:
                continue
            got = K.beam_topk(logits, cum, w, bp)
            # Every plan picks the reference's pairs; scores to float32 rounding (the lse sums in another order), the
            # rule of tests/ops/test_beam_kernel.py.
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), bp
            assert (got[2].cpu() - want[2]).abs().max().item() <= 4e-6 * (1 + want[2].abs().max().item()), bp
            seen[bp] = graph_calls_us(lambda: K.beam_topk(logits, cum, w, bp))
        ranked = sorted(seen.items(), key=lambda kv: kv[1])
        for bp, us in ranked:
            rows.append({"parents": P, "vocab": V, "width": w, "select": _name(bp), "chunk": bp.chunk,
                         "chunks": bp.chunks, "k1": bp.k1, "candidates": bp.candidates(P),
                         "chunk_warps": bp.chunk_warps, "select_warps": bp.select_warps,
                         "select_block": bp.select_block, "us": round(us, 2),
                         "default": bp == default})
        print(f"P={P} V={V} width={w}: default {seen[default]:.2f} us ({default}); best:", flush=True)
        for name in a.select:
            best = [(bp, us) for bp, us in ranked if _name(bp) == name][:2]
            for bp, us in best:
                print(f"   {name:16s} {us:.2f} us  {bp}", flush=True)
    write_results("sweep_beam", rows, a.out, meta={"shapes": SHAPES, "selects": a.select})


if __name__ == "__main__":
    main()
