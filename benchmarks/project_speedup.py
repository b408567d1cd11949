"""Projected speedup at real model sizes, from measured numbers only (issue 18).

speedup = tau x (plain decode step) / (speculative round), where tau and the per-depth acceptance are the shipped
pair's, measured end to end on held-out prompts (``bench_e2e``'s ``accept_hist``), and the step costs are
``bench_step_latency``'s for random-weight Llama-3-8B / Qwen2.5-32B shapes at the same context (wall time of a
plain step and of a LongSpec round with its one host sync, CUDA graphs; compiled and eager forwards). Nothing is
modelled beyond that product; it assumes the pair's acceptance carries over to a real pair of that size.

Usage: ``python -m benchmarks.project_speedup --e2e benchmarks/results/h200/e2e.json
--steps benchmarks/results/h200/step_latency.json --context 32768 --out benchmarks/results/h200``.
"""
from __future__ import annotations

import argparse
import json

from benchmarks.harness import write_results


def project(e2e_rows: list[dict], step_rows: list[dict], context: int, method: str,
            prompts: str = "repository", tree: str = "4-16-16-16-16") -> list[dict]:
    """One row per (model, compile, temperature) measured at ``context`` on ``prompts`` (a bench_e2e prompt kind);
    ``tree`` picks the step rows, and must be the tree ``method`` decoded with end to end."""
    pair_rows = {r["T"]: r for r in e2e_rows if r["context"] == context and r["method"] == method
                 and r.get("prompts", "repository") == prompts}
    if not pair_rows:
        raise ValueError(f"no {method!r} row at context {context} in the e2e results")
    steps = [r for r in step_rows if r["context"] == context and r["model"] != "pair"
             and r.get("tree", "4-16-16-16-16") == tree]
    if not steps:
        raise ValueError(f"no step-latency row at context {context} with tree {tree} for a real-size model")
    out = []
    for s in steps:
        for temperature, p in sorted(pair_rows.items()):
            hist = p["accept_hist"]
            tau = sum((i + 1) * c for i, c in enumerate(hist)) / sum(hist)
            out.append({"model": s["model"], "context": context, "compile": s["compile"], "T": temperature,
                        "tau": tau, "accept_by_depth": "/".join(f"{a:.2f}" for a in p["accept_by_depth"]),
                        "decode_ms": s["decode_wall_us"] / 1e3, "round_ms": s["round_wall_us"] / 1e3,
                        "round_per_decode": s["round_wall_us"] / s["decode_wall_us"],
                        "speedup": tau * s["decode_wall_us"] / s["round_wall_us"],
                        **{f"speedup_{key}": tau * s["decode_wall_us"] / s[f"round_{key}_wall_us"]
                           for key in DRAFT_VARIANTS if f"round_{key}_wall_us" in s}})
    return out


# bench_step_latency's drafting variants (a reduced drafting vocabulary, float8 weight copies, both): each round's
# own projection beside the 16-bit full-vocabulary one
DRAFT_VARIANTS = ("reduced", "fp8", "fp8_reduced")


COLUMNS = [("model", "model", ""), ("context", "context", ""), ("compile", "compiled", ""), ("T", "T", ""),
           ("tau", "pair tau", ".2f"), ("accept_by_depth", "accepted by depth", ""),
           ("decode_ms", "decode ms", ".2f"), ("round_ms", "round ms", ".2f"),
           ("round_per_decode", "round / decode", ".2f"), ("speedup", "projected speedup", ".2f"),
           ("speedup_reduced", "reduced vocab", ".2f"), ("speedup_fp8", "float8", ".2f"),
           ("speedup_fp8_reduced", "float8, reduced vocab", ".2f")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--e2e", required=True, help="bench_e2e's e2e.json (the shipped pair, held-out prompts)")
    ap.add_argument("--steps", required=True, help="bench_step_latency's step_latency.json")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--method", default="LongSpec tree")
    ap.add_argument("--prompts", default="repository", help="the bench_e2e prompt kind whose acceptance to project")
    ap.add_argument("--tree", default="4-16-16-16-16",
                    help="the step rows' tree: the one --method decoded with (e.g. 'LongSpec tree 4-12-12-12-12')")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    with open(a.e2e) as f:
        e2e = json.load(f)
    with open(a.steps) as f:
        steps = json.load(f)
    try:
        rows = project(e2e["rows"], steps["rows"], a.context, a.method, a.prompts, a.tree)
    except ValueError as err:
        ap.error(str(err))
    meta = {"e2e": a.e2e, "e2e_git_sha": e2e.get("environment", e2e.get("meta", {})).get("git_sha"),
            "steps": a.steps, "steps_git_sha": steps.get("meta", {}).get("git_sha"), "method": a.method, "tree": a.tree}
    write_results("projection", rows, a.out, meta=meta, title=f"Projected speedup at {a.context} tokens",
                  columns=COLUMNS, env=e2e.get("environment"),
                  notes=["speedup = the pair's measured tau x plain step / LongSpec round (both measured); "
                         "`python -m benchmarks.project_speedup`"])
    for r in rows:
        variants = "".join(f", {key} x{r[f'speedup_{key}']:.2f}" for key in DRAFT_VARIANTS if f"speedup_{key}" in r)
        print(f"{r['model']:12s} compile={r['compile']!s:5s} T={r['T']} tau {r['tau']:.2f} "
              f"round/decode {r['round_per_decode']:.2f} -> x{r['speedup']:.2f}{variants}")


if __name__ == "__main__":
    main()
