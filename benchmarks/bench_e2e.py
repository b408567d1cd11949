"""End-to-end long-code completion with a trained pair: every method on held-out repository prompts.

Input: the directory written by ``python -m longspec.recipes.code_pair --out DIR`` (``DIR/target`` with its
tokenizer, the draft checkpoint(s) named in ``DIR/recipe.json``, ``DIR/corpus/heldout.jsonl``). For each context
budget, temperature and method it decodes the same prompts and reports tau (tokens per target forward), decode
tokens/s (prefill excluded), the speedup over Vanilla FA, the draft's persistent memory and the tree's scratch rows
in the target cache, and whether the output equals Vanilla FA's (T = 0 greedy; T > 0 seed-exact sampling).

Methods: Vanilla HF (``target.generate`` with transformers' eager attention), Vanilla FA (the engine's plain
decoding on longspec's kernels), PLD (chain of 6), streaming self-speculation (sink 32 + window 1024, chain of 4,
MagicDec-style), LongSpec tree (4-16-16-16-16) and LongSpec chain (5), plus every ablation draft the recipe trained.
Usage (GPU): ``python -m benchmarks.bench_e2e --pair DIR --contexts 4096 8192 16384 32768 --out RESULTS``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import torch

from benchmarks.harness import write_results as write_results_files
from longspec import LongSpecDraft, LongSpecDrafter, PromptLookupDrafter, SpeculativeDecoder, StreamingSelfDrafter
from longspec.testing import first_difference
from longspec.train.corpus import heldout_prompts

VANILLA_HF, VANILLA_FA = "Vanilla HF", "Vanilla FA"


@dataclass
class Pair:
    target: torch.nn.Module
    tokenizer: object
    drafts: dict[str, LongSpecDraft]  # recipe variant name -> draft
    heldout: str


def load_pair(pair_dir: str, device: str, dtype: torch.dtype) -> Pair:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(pair_dir, "recipe.json")) as f:
        record = json.load(f)
    target_dir = os.path.join(pair_dir, "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    checkpoints = record.get("ablations", {}).get("checkpoints") or {"draft": record["draft"]["checkpoint"]}
    drafts = {name: LongSpecDraft.from_pretrained(path, target=target) for name, path in checkpoints.items()}
    return Pair(target, tokenizer, drafts, os.path.join(pair_dir, "corpus", "heldout.jsonl"))


def methods(pair: Pair) -> dict[str, tuple]:
    """name -> (drafter factory or None, tree shape); Vanilla HF is handled separately."""
    out = {
        VANILLA_FA: (lambda: None, (1,)),
        "PLD chain 6": (PromptLookupDrafter, (1,) * 6),
        "streaming self-spec chain 4": (lambda: StreamingSelfDrafter(sink=32, window=1024), (1,) * 4),
    }
    for name, draft in pair.drafts.items():
        label = "LongSpec" if name == "draft" else f"LongSpec ({name.replace('draft_', '')})"
        out[f"{label} tree"] = (lambda d=draft: LongSpecDrafter(d), (4, 16, 16, 16, 16))
        if name == "draft":
            out[f"{label} chain 5"] = (lambda d=draft: LongSpecDrafter(d), (1,) * 5)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(pair: Pair, factory, shape, prompts, new_tokens: int, temperature: float, device: str) -> dict:
    drafter = factory()
    dec = SpeculativeDecoder(pair.target, drafter, tree_shape=shape, cuda_graphs=device.startswith("cuda"))
    dec.generate(prompts[0], 8, eos_token_id=[])  # warm-up: kernel compilation, graph capture
    emitted = forwards = 0
    seconds = 0.0
    outputs = []
    for i, ids in enumerate(prompts):
        _sync(device)
        out = dec.generate(ids, new_tokens, temperature=temperature, seed=i, eos_token_id=[])
        _sync(device)
        seconds += out.stats.time_decode
        emitted += sum(sum(a) for a in out.accept_lengths)
        forwards += sum(len(a) for a in out.accept_lengths)
        outputs.append(out.sequences[:, ids.shape[1]:])
    tree_rows = 0 if drafter is None else dec.tree.num_nodes
    cache = dec._cache
    per_row = cache.kv[:, :, 0, 0].numel() * cache.kv.element_size()  # one row of K and V over all layers
    draft_bytes = drafter.nbytes() if hasattr(drafter, "nbytes") else 0
    return {"tau": emitted / max(1, forwards), "tokens_per_s": emitted / seconds, "draft_bytes": draft_bytes,
            "tree_scratch_bytes": tree_rows * per_row, "outputs": outputs}


def run_hf(pair: Pair, prompts, new_tokens: int, temperature: float, device: str) -> dict:
    """transformers' own generate with eager attention; decode time = generate(n) - generate(1) per prompt."""
    target = pair.target
    previous = target.config._attn_implementation
    target.set_attn_implementation("eager")
    kw = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=None,
              top_p=None, eos_token_id=None, pad_token_id=0)
    try:
        seconds, outputs = 0.0, []
        for i, ids in enumerate(prompts):
            times = []
            for n in (1, new_tokens):
                torch.manual_seed(i)
                _sync(device)
                t0 = time.perf_counter()
                seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, **kw)
                _sync(device)
                times.append(time.perf_counter() - t0)
            seconds += max(times[1] - times[0], 1e-9)
            outputs.append(seq[:, ids.shape[1]:])
    finally:
        target.set_attn_implementation(previous)
    return {"tau": 1.0, "tokens_per_s": (new_tokens - 1) * len(prompts) / seconds, "draft_bytes": 0,
            "tree_scratch_bytes": 0, "outputs": outputs}


def bench(pair: Pair, contexts, n_prompts: int, new_tokens: int, temperatures, device: str, hf: bool,
          on_rows=None) -> list[dict]:
    """Every method at every (context, temperature); ``on_rows(rows)`` is called after each such block (so a run
    cut short keeps what it measured)."""
    rows = []
    for ctx in contexts:
        prompts, packages = heldout_prompts(pair.heldout, pair.tokenizer, ctx, n_prompts, seed=ctx)
        prompts = [p.to(device) for p in prompts]
        for temperature in temperatures:
            results = {}
            if hf:
                results[VANILLA_HF] = run_hf(pair, prompts, new_tokens, temperature, device)
            for name, (factory, shape) in methods(pair).items():
                results[name] = run_engine(pair, factory, shape, prompts, new_tokens, temperature, device)
            base = results[VANILLA_FA]
            base_outputs = base["outputs"]
            for name, r in results.items():
                diffs = [first_difference(a, b) for a, b in zip(r.pop("outputs"), base_outputs)]
                diffs = [d for d in diffs if d is not None]
                same = not diffs
                rows.append({"context": ctx, "T": temperature, "method": name, **r,
                             "speedup_vs_FA": r["tokens_per_s"] / base["tokens_per_s"],
                             "identical_to_FA": same, "first_difference": min(diffs) if diffs else None,
                             "packages": packages})
                print(f"ctx {ctx:6d} T {temperature} {name:32s} tau {r['tau']:.2f} "
                      f"{r['tokens_per_s']:8.1f} tok/s x{rows[-1]['speedup_vs_FA']:.2f} same={same}", flush=True)
            if on_rows is not None:
                on_rows(rows)
    return rows


COLUMNS = [("context", "context", ""), ("T", "T", ""), ("method", "method", ""), ("tau", "tau", ".2f"),
           ("tokens_per_s", "tokens/s", ".1f"), ("speedup_vs_FA", "speedup vs FA", ".2f"),
           ("draft_mb", "draft MB", ".2f"), ("tree_scratch_mb", "tree scratch MB", ".2f"),
           ("identical_to_FA", "same as FA", "")]


def write_results(rows: list[dict], meta: dict, out_dir: str | None) -> None:
    """e2e.json / e2e.md (rows by context and temperature, methods in their order) and e2e.png."""
    rows = sorted(rows, key=lambda r: (r["context"], r["T"]))  # stable: methods keep their order
    table = [{**r, "draft_mb": r["draft_bytes"] / 2**20, "tree_scratch_mb": r["tree_scratch_bytes"] / 2**20}
             for r in rows]
    write_results_files("e2e", table, out_dir, meta=meta, title="Long-code completion, end to end", columns=COLUMNS,
                        notes=["tau / decode tokens/s (prefill excluded) / speedup over Vanilla FA; `python -m "
                               "benchmarks.bench_e2e`"], plot=plot_results)


def plot_results(rows: list[dict], out_path) -> None:
    """tau and speedup over Vanilla FA against context, one panel per temperature (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["T"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != VANILLA_FA))
    fig, axes = plt.subplots(2, len(temps), figsize=(6 * len(temps), 8), squeeze=False)
    for j, temperature in enumerate(temps):
        for m in methods:
            pts = sorted((r["context"], r["tau"], r["speedup_vs_FA"]) for r in rows
                         if r["method"] == m and r["T"] == temperature)
            if not pts:
                continue
            ctx = [p[0] for p in pts]
            axes[0][j].plot(ctx, [p[1] for p in pts], marker="o", label=m)
            axes[1][j].plot(ctx, [p[2] for p in pts], marker="o", label=m)
        axes[0][j].set_title(f"T = {temperature}: tau (tokens per target forward)")
        axes[1][j].set_title(f"T = {temperature}: decode tokens/s over Vanilla FA")
        axes[1][j].axhline(1.0, color="gray", lw=0.8)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", help="recipe output directory")
    ap.add_argument("--replot", metavar="E2E_JSON", help="only redraw e2e.png from an earlier run's e2e.json")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--no-hf", action="store_true", help="skip Vanilla HF (slow at long context)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    a = ap.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            plot_results(json.load(f)["rows"], os.path.join(os.path.dirname(a.replot), "e2e.png"))
        return
    if not a.pair:
        ap.error("--pair is required (or --replot)")
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    pair = load_pair(a.pair, a.device, dtype)
    meta = {"device": a.device, "dtype": str(dtype), "prompts_per_context": a.prompts, "new_tokens": a.new_tokens}
    with torch.inference_mode():
        bench(pair, a.contexts, a.prompts, a.new_tokens, a.temperatures, a.device, hf=not a.no_hf,
              on_rows=lambda rows: write_results(rows, meta, a.out))


if __name__ == "__main__":
    main()
