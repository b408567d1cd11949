"""Sweep ``beam_topk``'s launch plan on the GPU at the draft levels' shapes (bf16 logits, B 1).

Each plan (:class:`longspec_ops.kernels.beam.BeamPlan`: candidates per batch row, values per thread of the chunk
and the select kernel) is timed as the drafter runs it: 20 calls in one CUDA graph, logits warm in L2 (the LM head
has just written them), the median of 5 replays per call. Prints per shape the fastest plans and the default's
time; writes ``sweep_beam.json``. Usage (GPU): ``python -m benchmarks.sweep_beam [--out DIR]``.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.harness import write_results
from benchmarks.timing import graph_calls_us
from longspec_ops.kernels import beam as K

# (parents, vocabulary, width): the 4-16-16-16-16 tree's levels over the shipped pair's 2048-token drafting
# vocabulary, a 32k drafting vocabulary and Llama-3's full 128,256.
SHAPES = [(P, V, w) for V in (2048, 32768, 128256) for P, w in ((1, 4), (4, 16), (16, 16))]
TARGETS = (512, 1024, 2048, 4096)
CHUNK_PER_THREAD = (4, 8, 16, 32)
SELECT_PER_THREAD = (2, 4, 8, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for P, V, w in SHAPES:
        logits = (torch.randn(1, P, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
        cum = torch.randn(1, P, device="cuda", generator=g)
        want = K.beam_topk(logits, cum, w)
        default = K.plan(P, V, w)
        seen = {}
        plans = [K.plan(P, V, w, target_candidates=t, chunk_per_thread=cpt, select_per_thread=spt)
                 for t, cpt, spt in itertools.product(TARGETS, CHUNK_PER_THREAD, SELECT_PER_THREAD)]
        for bp in plans:
            if bp in seen:
                continue
            got = K.beam_topk(logits, cum, w, bp)
            # Every plan picks the same pairs; scores may differ in the last bit (the lse sums in another order).
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), bp
            assert torch.allclose(got[2], want[2], rtol=1e-6, atol=1e-5), bp
            seen[bp] = graph_calls_us(lambda: K.beam_topk(logits, cum, w, bp))
        ranked = sorted(seen.items(), key=lambda kv: kv[1])
        for bp, us in ranked:
            rows.append({"parents": P, "vocab": V, "width": w, "chunk": bp.chunk, "chunks": bp.chunks, "k1": bp.k1,
                         "candidates": bp.candidates(P), "chunk_warps": bp.chunk_warps,
                         "select_warps": bp.select_warps, "us": round(us, 2), "default": bp == default})
        print(f"P={P} V={V} width={w}: default {seen[default]:.2f} us ({default}); best:", flush=True)
        for bp, us in ranked[:4]:
            print(f"   {us:.2f} us  {bp}", flush=True)
    write_results("sweep_beam", rows, a.out, meta={"shapes": SHAPES})


if __name__ == "__main__":
    main()
