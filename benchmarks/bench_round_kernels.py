"""The adaptive round's two bookkeeping ops against the PyTorch they replace, and their memory floor.

* ``prompt_lookup_chain`` (prompt lookup's best chain per row, two Triton launches) against its PyTorch reference
  (:mod:`longspec_ops.reference.lookup`: one ``unfold`` match per n-gram size, a ``max`` and a gather), at each
  context and batch, 16 drafts, n-grams 1..3. Floor: the token ids read once (``B * C * 8`` bytes) at the copy
  bandwidth measured in the same run.
* ``record_acceptance_`` (one verified round counted into an ``AdaptiveBudget``'s statistics, one launch) against
  its PyTorch reference (:mod:`longspec_ops.reference.stats`, ~25 small kernels), at the shipped pair's merged
  pool (85 nodes, 23 options, 4352 cells) for each batch. Floor: the tables and the round's inputs read and the tables
  written once.

Every time is the median of CUDA-graph replays with a cold L2 (:class:`benchmarks.timing.Timer`): the ops run inside
captured graphs in the engine, where a launch costs ~2-3 us. Texts are random over a 64-token vocabulary with a
planted repeat near the root (so a match exists and the continuation reads the text).

Usage (GPU): ``python -m benchmarks.bench_round_kernels --out RESULTS``.
"""
from __future__ import annotations

import argparse
import os

import torch

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)
from benchmarks.harness import write_results
from benchmarks.timing import Timer, measure_peaks, roofline_us
from longspec_ops.reference import lookup as lookup_ref
from longspec_ops.reference import stats as stats_ref

DEPTH, MIN_NGRAM, MAX_NGRAM = 16, 1, 3
POOL_NODES, OPTIONS, CELLS, PATH = 85, 23, 4352, 17  # bench_adaptive's merged pool: 2^2 sources x 17 depths x 16


def lookup_case(B: int, C: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (B, C), generator=g)
    tokens[:, C - 40: C - 20] = tokens[:, C - 300: C - 280]  # a repeat: the suffix at the root matches earlier text
    seqlens = torch.full((B,), C - 21, dtype=torch.int32)
    return tokens.to(device), seqlens.to(device)


def stats_case(B: int, device: str, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    state = [torch.rand(CELLS, generator=g), torch.rand(CELLS, generator=g), 1 + torch.rand(OPTIONS, generator=g),
             torch.rand(OPTIONS, generator=g), torch.ones(OPTIONS, dtype=torch.bool)]
    accept_index = torch.arange(PATH).expand(B, PATH).clone()
    inputs = [torch.randint(0, CELLS, (B, POOL_NODES), generator=g),
              (torch.rand(B, POOL_NODES, OPTIONS, generator=g) < 0.3).float(),
              torch.rand(OPTIONS, generator=g) < 0.5, accept_index, torch.randint(1, PATH + 1, (B,), generator=g),
              torch.ones(B, dtype=torch.bool)]
    return [t.to(device) for t in state], [t.to(device) for t in inputs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_round_kernels times CUDA graphs: it needs a GPU")
    timer, peaks = Timer(reps=a.reps, warmup=3), measure_peaks()
    rows = []
    for B in a.batches:
        for C in a.contexts:
            tokens, seqlens = lookup_case(B, C, "cuda")
            got = torch.ops.longspec.prompt_lookup_chain(tokens, seqlens, DEPTH, MIN_NGRAM, MAX_NGRAM)
            want = lookup_ref.prompt_lookup_chain(tokens, seqlens, DEPTH, MIN_NGRAM, MAX_NGRAM)
            same = all(torch.equal(x, y) for x, y in zip(got, want))
            kernel = timer.graph_us(lambda: torch.ops.longspec.prompt_lookup_chain(tokens, seqlens, DEPTH, MIN_NGRAM,
                                                                                   MAX_NGRAM))
            torch_us = timer.graph_us(lambda: lookup_ref.prompt_lookup_chain(tokens, seqlens, DEPTH, MIN_NGRAM,
                                                                             MAX_NGRAM))
            floor = roofline_us(tokens.numel() * tokens.element_size(), 0.0, peaks)
            rows.append({"op": "prompt_lookup_chain", "batch": B, "size": f"C={C}", "kernel_us": kernel,
                         "pytorch_us": torch_us, "speedup": torch_us / kernel, "floor_us": floor, "same": same})
            print(rows[-1], flush=True)
        state, inputs = stats_case(B, "cuda")
        want = [t.clone() for t in state]
        stats_ref.record_acceptance_(*want, *inputs, 0.999, 0.2)
        got = [t.clone() for t in state]
        torch.ops.longspec.record_acceptance_(*got, *inputs, 0.999, 0.2)
        same = all(torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-5) for x, y in zip(got, want))
        kernel = timer.graph_us(lambda: torch.ops.longspec.record_acceptance_(*got, *inputs, 0.999, 0.2))
        torch_us = timer.graph_us(lambda: stats_ref.record_acceptance_(*want, *inputs, 0.999, 0.2))
        moved = 2 * sum(t.numel() * t.element_size() for t in state) + sum(t.numel() * t.element_size() for t in inputs)
        rows.append({"op": "record_acceptance_", "batch": B, "size": f"T={POOL_NODES} K={OPTIONS} cells={CELLS}",
                     "kernel_us": kernel, "pytorch_us": torch_us, "speedup": torch_us / kernel,
                     "floor_us": roofline_us(moved, 0.0, peaks), "same": same})
        print(rows[-1], flush=True)
    write_results("round_kernels", rows, a.out, meta={"depth": DEPTH, "ngrams": [MIN_NGRAM, MAX_NGRAM], **peaks},
                  columns=[("op", "op", ""), ("batch", "batch", ""), ("size", "size", ""),
                           ("kernel_us", "kernel us", ".1f"), ("pytorch_us", "PyTorch us", ".1f"),
                           ("speedup", "speedup", ".1f"), ("floor_us", "memory floor us", ".2f"),
                           ("same", "same as reference", "")],
                  title="Adaptive-round bookkeeping kernels",
                  notes=["CUDA-graph replays, cold L2, medians; `same`: the kernel's outputs equal the reference's "
                         "(exact for the lookup, 1e-5 for the statistics); `python -m benchmarks.bench_round_kernels`"])


if __name__ == "__main__":
    main()
