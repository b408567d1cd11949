"""First-call speed after ``SpeculativeDecoder.warmup``: does a warmed decoder run its first request at steady speed?

For each method on the shipped pair (bf16, CUDA graphs; ``--compile`` adds ``compile=True`` runs) one decoder is
built and warmed up once for every context asked (``warmup(batch_sizes=(1,), max_context=longest + new tokens)``);
then at each context one held-out prompt is decoded three times: the first call, and two more whose mean is the
steady speed. Reported: the warm-up's seconds, decode tokens/s of the first call and the steady ones, their ratio,
and the graphs the first call captured (0 when the warm-up covered it). ``--warmup-batches`` also times the
adaptive merged decoder's warm-up for several batch sizes at the longest context, part by part.
``--learn-prompts K`` adds the adaptive decoder started from saved statistics (``AdaptiveBudget(stats=...)``): a first
decoder decodes K other held-out prompts at every context and saves its budget's statistics, then a new decoder is
built from them, warmed up and measured as above.

Usage (GPU): ``python -m benchmarks.bench_first_call --contexts 16384 32768 --compile --warmup-batches 1 16``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from benchmarks.bench_adaptive import ADAPTIVE, TREE, merged_budget, merged_drafter, merged_spec
from benchmarks.harness import write_results
from longspec import LongSpecDrafter, PromptLookupDrafter, SpeculativeDecoder
from longspec.pretrained import heldout_stdlib_prompt, load_code_pair


SAVED = f"{ADAPTIVE}, saved statistics"


def methods(draft, stats=None) -> dict:
    """name -> (drafter factory, tree, budget factory); ``stats``: the saved statistics of the ``SAVED`` method."""
    out = {
        "plain": (lambda: None, (1,), None),
        "PLD chain 6": (PromptLookupDrafter, (1,) * 6, None),
        "LongSpec tree": (lambda: LongSpecDrafter(draft), TREE, None),
        ADAPTIVE: (lambda: merged_drafter(draft), merged_spec(TREE), merged_budget),
    }
    if stats is not None:
        out[SAVED] = (lambda: merged_drafter(draft), merged_spec(TREE), lambda: merged_budget(stats=stats))
    return out


def learn_stats(pair, prompts: list, new_tokens: int) -> str:
    """Decode ``prompts`` with a fresh adaptive decoder; the path of its budget's saved statistics."""
    budget = merged_budget()
    dec = SpeculativeDecoder(pair.target, merged_drafter(pair.draft), tree_shape=merged_spec(TREE), cuda_graphs=True,
                             budget=budget)
    dec.warmup(batch_sizes=(1,), max_context=max(p.shape[1] for p in prompts) + new_tokens, progress=False)
    for ids in prompts:
        dec.generate(ids, new_tokens, eos_token_id=[])
    path = tempfile.mkdtemp() + "/stats.pt"
    budget.save_stats(path)
    del dec
    torch.cuda.empty_cache()
    return path


def first_call_rows(pair, prompts: dict, new_tokens: int, compile: bool, names, stats=None) -> list[dict]:
    rows = []
    longest = max(p.shape[1] for p in prompts.values())
    for name, (factory, shape, budget) in methods(pair.draft, stats).items():
        if names and name not in names:
            continue
        dec = SpeculativeDecoder(pair.target, factory(), tree_shape=shape, cuda_graphs=True, compile=compile,
                                 budget=budget() if budget is not None else None)
        report = dec.warmup(batch_sizes=(1,), max_context=longest + new_tokens, progress=False)
        print(f"{name} compile={compile}: {report}", flush=True)
        for context, ids in prompts.items():
            calls = []
            for _ in range(3):
                torch.cuda.synchronize()
                out = dec.generate(ids, new_tokens, eos_token_id=[])
                torch.cuda.synchronize()
                calls.append(out.stats)
            first, steady = calls[0], calls[1:]
            tps = [s.generated_tokens / s.time_decode for s in calls]
            steady_tps = sum(tps[1:]) / len(steady)
            rows.append({"method": name, "compile": compile, "context": context, "warmup_s": report.seconds,
                         "first_tok_s": tps[0], "steady_tok_s": steady_tps, "first_over_steady": tps[0] / steady_tps,
                         "first_captures": first.captures, "first_capture_s": first.time_capture, "tau": first.tau})
            print(rows[-1], flush=True)
        del dec
        torch.cuda.empty_cache()
    return rows


def warmup_rows(pair, batches, context: int, new_tokens: int) -> list[dict]:
    """The adaptive merged decoder's warm-up for ``batches`` at ``context`` (its costs calibrated afresh)."""
    budget = merged_budget()
    budget.cache_dir = tempfile.mkdtemp()  # no costs from disk: the calibration is part of what is timed
    dec = SpeculativeDecoder(pair.target, merged_drafter(pair.draft), tree_shape=merged_spec(TREE), cuda_graphs=True,
                             budget=budget)
    report = dec.warmup(batch_sizes=batches, max_context=context + new_tokens, progress=False)
    print(f"{ADAPTIVE} warmup {batches} at {context}: {report}", flush=True)
    rows = [{"method": f"{ADAPTIVE} warmup", "batch": s.batch, "context": context, "calibrate_s": s.calibrate_s,
             "rounds_s": s.rounds_s, "captures": s.captures} for s in report.steps]
    rows.append({"method": f"{ADAPTIVE} warmup", "batch": "all", "context": context, "total_s": report.seconds,
                 "slot_mib": report.slot_bytes / 2**20, "graph_mib": (report.graph_bytes or 0) / 2**20})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-seed", type=int, default=101, help="heldout_stdlib_prompt seed (not the demo's)")
    p.add_argument("--compile", action="store_true", help="also the compile=True decoders")
    p.add_argument("--compile-methods", nargs="*", default=["LongSpec tree"], help="methods run with compile=True")
    p.add_argument("--methods", nargs="*", default=None, help="methods run without compile (default: all)")
    p.add_argument("--warmup-batches", type=int, nargs="*", default=[])
    p.add_argument("--learn-prompts", type=int, default=0,
                   help="held-out prompts per context (other seeds) the saved-statistics decoder learns from first")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_first_call needs a CUDA device (CUDA graphs)")
    pair = load_code_pair("cuda", torch.bfloat16)
    prompts = {c: heldout_stdlib_prompt(pair.tokenizer, c, seed=args.prompt_seed)[0].cuda() for c in args.contexts}
    t0 = time.perf_counter()
    stats = None
    if args.learn_prompts:
        learn = [heldout_stdlib_prompt(pair.tokenizer, c, seed=args.prompt_seed + 1 + i)[0].cuda()
                 for i in range(args.learn_prompts) for c in args.contexts]
        stats = learn_stats(pair, learn, args.new_tokens)
    rows = first_call_rows(pair, prompts, args.new_tokens, False, args.methods, stats)
    if args.compile:
        rows += first_call_rows(pair, prompts, args.new_tokens, True, args.compile_methods)
    if args.warmup_batches:
        rows += warmup_rows(pair, args.warmup_batches, max(args.contexts), args.new_tokens)
    meta = {"contexts": args.contexts, "new_tokens": args.new_tokens, "prompt_seed": args.prompt_seed,
            "learn_prompts": args.learn_prompts,
            "dtype": "bfloat16", "seconds": time.perf_counter() - t0}
    columns = [("method", "method", ""), ("compile", "compile", ""), ("context", "context", ""),
               ("batch", "batch", ""), ("warmup_s", "warm-up s", ".1f"), ("first_tok_s", "first tok/s", ".0f"),
               ("steady_tok_s", "steady tok/s", ".0f"), ("first_over_steady", "first / steady", ".3f"),
               ("first_captures", "graphs captured in the first call", ""), ("tau", "tau", ".2f"),
               ("calibrate_s", "calibrate s", ".1f"), ("rounds_s", "compile + capture s", ".1f"),
               ("captures", "graphs", ""), ("total_s", "total s", ".1f"), ("slot_mib", "caches MiB", ".0f"),
               ("graph_mib", "graphs MiB", ".0f")]
    write_results("first_call", rows, args.out, meta=meta, columns=columns,
                  title="First call after warmup(): the shipped pair, bf16, CUDA graphs",
                  notes=["python -m benchmarks.bench_first_call " + " ".join(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
