"""Acceptance of LongSpec beam trees of other shapes on the shipped pair: which trees keep the 69-node tree's tau.

For held-out repository prompts of this interpreter's standard library (``longspec.pretrained.heldout_stdlib_prompt``,
one package per seed), every tree shape decodes the same prompts greedily with the shipped pair, and the rows give
tau (tokens per target forward, over all rounds of all prompts), the per-depth acceptance and tau over the first
shape's (the reference, 4-16-16-16-16 by default). ``bench_step_latency --tree-tau`` reads the result to price the
cheapest shape that keeps >= 95% of the reference's tau. Greedy acceptance depends on the draft and target only, not
on the device or the kernels' rounding beyond near-ties, so this runs where a GPU is not needed (float32 on CPU).

``--fp8`` adds, after each tree's row, the same tree drafted from float8 weight copies
(``LongSpecDrafter(weight_dtype=torch.float8_e4m3fn)``), with its tau over the 16-bit row's.

Usage: ``python -m benchmarks.tree_tau --context 8192 --prompts 3 --new-tokens 128 --out benchmarks/results/cpu``.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import tree_shape, write_results

TREES = ["4-16-16-16-16", "4-16-16-16", "4-16-16", "4-12-12-12-12", "4-8-8-8-8", "4-8-8-8", "3-6-6-6-6",
         "2-4-4-4-4", "4-8-8-4-4"]


def measure(trees: list[str], context: int, prompts: int, new_tokens: int, device: str, dtype: torch.dtype,
            on_row=lambda row: None, fp8: bool = False) -> list[dict]:
    from longspec import LongSpecDrafter, SpeculativeDecoder
    from longspec.pretrained import heldout_stdlib_prompt, load_code_pair

    pair = load_code_pair(device, dtype)
    inputs = [heldout_stdlib_prompt(pair.tokenizer, context, seed=100 + i) for i in range(prompts)]
    rows = []
    for tree, weight_dtype in [(t, w) for t in trees for w in ((None, torch.float8_e4m3fn) if fp8 else (None,))]:
        spec = tree_shape(tree)
        dec = SpeculativeDecoder(pair.target, LongSpecDrafter(pair.draft, weight_dtype=weight_dtype), tree_shape=spec,
                                 cuda_graphs=device.startswith("cuda"))
        lengths, t0 = [], time.perf_counter()
        for ids, _ in inputs:
            out = dec.generate(ids.to(device), max_new_tokens=new_tokens)
            lengths += out.accept_lengths[0]
        tau = sum(lengths) / len(lengths)
        depth = len(spec)
        by_depth = [sum(n > d for n in lengths) / len(lengths) for d in range(1, depth + 1)]
        row = {"tree": tree, "weights": "float8" if weight_dtype else "16-bit", "nodes": 1 + sum(spec),
               "depth": depth, "rounds": len(lengths), "tau": tau,
               "accept_by_depth": "/".join(f"{a:.2f}" for a in by_depth), "seconds": time.perf_counter() - t0}
        row["tau_vs_first"] = tau / rows[0]["tau"] if rows else 1.0
        if weight_dtype is not None:
            row["tau_vs_16bit"] = tau / rows[-1]["tau"]
        rows.append(row)
        on_row(row)
        print(row, flush=True)
    return rows


COLUMNS = [("tree", "tree", ""), ("weights", "draft weights", ""), ("nodes", "nodes", ""), ("depth", "depth", ""),
           ("rounds", "rounds", ""), ("tau", "tau", ".2f"), ("tau_vs_first", "tau / first", ".3f"),
           ("tau_vs_16bit", "tau / 16-bit", ".3f"), ("accept_by_depth", "accepted by depth", "")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", type=lambda t: "-".join(map(str, tree_shape(t))), default=TREES, help="nodes per depth, dash-separated; the first is the "
                                                                "reference")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fp8", action="store_true", help="also each tree drafted from float8 weight copies")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    meta = {"context": a.context, "prompts": a.prompts, "new_tokens": a.new_tokens, "dtype": str(dtype),
            "prompts_from": "heldout_stdlib_prompt seeds 100..", "temperature": 0.0}
    rows: list[dict] = []

    def on_row(row):
        rows.append(row)
        write_results("tree_tau", rows, a.out, meta=meta, title="LongSpec tree shapes on the shipped pair: tau",
                      columns=COLUMNS, notes=["greedy; tau over all rounds of all prompts; "
                                              "`python -m benchmarks.tree_tau`"])

    measure(a.trees, a.context, a.prompts, a.new_tokens, a.device, dtype, on_row, fp8=a.fp8)


if __name__ == "__main__":
    main()
