"""End-to-end long-code completion with a trained pair: every method on held-out repository prompts.

Input: the directory written by ``python -m longspec.recipes.code_pair --out DIR`` (``DIR/target`` with its
tokenizer, the draft checkpoint(s) named in ``DIR/recipe.json``, ``DIR/corpus/heldout.jsonl``), or an exported
pair (the shipped ``longspec/assets/code-pair``) with ``--heldout`` the held-out split. For each context
budget, temperature and method it decodes the same prompts and reports tau (tokens per target forward), decode
tokens/s (prefill and CUDA-graph capture excluded: the capture of a call's draft and tail graphs is reported
apart, per call), the speedup over Vanilla FA, peak GPU memory, the draft's persistent memory and the
tree's scratch rows in the target cache, the per-depth acceptance of the drafters (the accept-length histogram is in
the json: ``benchmarks/project_speedup.py`` reads it), and whether the output equals Vanilla FA's (T = 0 greedy;
T > 0 seed-exact sampling); ``--fp32-check`` repeats the comparison in float32, where it must hold.

Methods: Vanilla HF (``target.generate`` with transformers' eager attention; recorded as out of memory where its
context x context score matrices do not fit), Vanilla FA (the engine's plain decoding on longspec's kernels), PLD
(chain of 6), streaming self-speculation (sink 32 + window 1024, chain of 4, MagicDec-style), LongSpec tree
(4-16-16-16-16), LongSpec chain (5) and the adaptive merged drafter (LongSpec tree + PLD chain in one tree under an
:class:`~longspec.AdaptiveBudget`, calibrated at each context first), plus every ablation draft the recipe trained.
Each engine method builds one decoder per context (one warm-up, one graph capture) and decodes every prompt at every
temperature with it. ``--prompt-kinds`` picks the held-out prompts (:func:`longspec.train.corpus.heldout_prompts`):
``repository`` (one package's files, the default), ``packages`` (files of several packages in turn) and
``skeleton`` (several packages' outlines, so the continuation is mostly not in the prompt); each kind is its own set
of rows (column ``prompts``; the plot shows the first kind).
Contexts run in the order given, and the results are rewritten after each, so a run cut short keeps what it
measured; ``--merge`` combines runs split over several device calls.
Usage (GPU): ``python -m benchmarks.bench_e2e --pair DIR --contexts 32768 65536 16384 8192 4096 --out RESULTS``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from benchmarks.bench_adaptive import ADAPTIVE, TREE, merged_budget, merged_drafter, merged_spec
from benchmarks.harness import tree_shape
from benchmarks.harness import write_results as write_results_files
from longspec import (LongSpecDraft, LongSpecDrafter, Numerics, PromptLookupDrafter, SpeculativeDecoder,
                      StreamingSelfDrafter)
from longspec.testing import first_difference
from longspec.train.corpus import PROMPT_KINDS, heldout_prompts

VANILLA_HF, VANILLA_FA = "Vanilla HF", "Vanilla FA"


@dataclass
class Pair:
    target: torch.nn.Module
    tokenizer: object
    drafts: dict[str, LongSpecDraft]  # recipe variant name -> draft
    heldout: str


def load_pair(pair_dir: str, device: str, dtype: torch.dtype, heldout: str | None = None) -> Pair:
    """A recipe's output directory (its drafts, ablations included, and its held-out split), or an exported pair
    (``target/``, ``draft/``, ``pair.json``: the shipped one) with the held-out split given as ``heldout``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = os.path.join(pair_dir, "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    if os.path.isfile(os.path.join(pair_dir, "recipe.json")):
        with open(os.path.join(pair_dir, "recipe.json")) as f:
            record = json.load(f)
        checkpoints = record.get("ablations", {}).get("checkpoints") or {"draft": record["draft"]["checkpoint"]}
    else:
        checkpoints = {"draft": os.path.join(pair_dir, "draft")}
    drafts = {name: LongSpecDraft.from_pretrained(path, target=target) for name, path in checkpoints.items()}
    return Pair(target, tokenizer, drafts, heldout or os.path.join(pair_dir, "corpus", "heldout.jsonl"))


def methods(pair: Pair, trees: Sequence[tuple[int, ...]] = ()) -> dict[str, tuple]:
    """name -> (drafter factory or None, tree shape, adaptive budget factory or None); Vanilla HF is handled
    separately. The adaptive row is ``bench_adaptive``'s merged LongSpec tree + PLD chain under its budget.
    ``trees``: more LongSpec tree shapes for the draft, each its own row ("LongSpec tree 4-12-12-12-12")."""
    out = {
        VANILLA_FA: (lambda: None, (1,), None),
        "PLD chain 6": (PromptLookupDrafter, (1,) * 6, None),
        "PLD chain 16": (PromptLookupDrafter, (1,) * 16, None),
        "streaming self-spec chain 4": (lambda: StreamingSelfDrafter(sink=32, window=1024), (1,) * 4, None),
    }
    for name, draft in pair.drafts.items():
        label = "LongSpec" if name == "draft" else f"LongSpec ({name.replace('draft_', '')})"
        out[f"{label} tree"] = (lambda d=draft: LongSpecDrafter(d), TREE, None)
        if name == "draft":
            out[f"{label} chain 5"] = (lambda d=draft: LongSpecDrafter(d), (1,) * 5, None)
            out[ADAPTIVE] = (lambda d=draft: merged_drafter(d), merged_spec(TREE), merged_budget)
            for shape in trees:
                out[f"{label} tree {'-'.join(map(str, shape))}"] = (lambda d=draft: LongSpecDrafter(d), shape, None)
    return out


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's ``unique_graphs`` counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _reset_peak(device: str) -> int:
    """Start a peak-memory window; returns the bytes allocated now (0 on a CPU, where nothing is measured)."""
    if not device.startswith("cuda"):
        return 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak(device: str, start: int) -> dict:
    """Peak bytes allocated in the window (``peak_bytes``, everything resident: weights, caches, activations) and
    its rise over what was allocated when the method began (``peak_extra_bytes``); None on a CPU."""
    if not device.startswith("cuda"):
        return {"peak_bytes": None, "peak_extra_bytes": None}
    _sync(device)
    peak = torch.cuda.max_memory_allocated()
    return {"peak_bytes": peak, "peak_extra_bytes": peak - start}


def accept_histogram(accept_lengths: list[list[int]]) -> list[int]:
    """Counts of tokens emitted per verify forward over all rows and rounds: index i counts rounds that emitted
    i + 1 tokens (accepted drafts + the bonus)."""
    flat = [a for row in accept_lengths for a in row]
    hist = [0] * max(flat, default=0)
    for a in flat:
        hist[a - 1] += 1
    return hist


def accept_by_depth(hist: list[int], depth: int) -> list[float]:
    """Per-depth acceptance from :func:`accept_histogram`: entry d - 1 is the fraction of rounds whose depth-d draft
    token was accepted (emitted at least d + 1 tokens). tau = 1 + sum(accept_by_depth)."""
    rounds = sum(hist)
    return [sum(hist[d:]) / rounds if rounds else 0.0 for d in range(1, depth + 1)]


def run_engine(pair: Pair, factory, shape, budget_factory, prompts, new_tokens: int, temperatures,
               device: str, compile: bool = False, numerics: str = "fast") -> dict:
    """{temperature: result} for one method: one decoder (one warm-up, one set of captured graphs) decodes every
    prompt at every temperature. An adaptive budget's costs are calibrated first, at this context (not timed in
    the rows; ``calibrate_s``). ``numerics``: the decoder's :class:`~longspec.Numerics`, by name."""
    start = _reset_peak(device)
    drafter = factory()
    budget = budget_factory() if budget_factory is not None else None
    dec = SpeculativeDecoder(pair.target, drafter, tree_shape=shape, cuda_graphs=device.startswith("cuda"),
                             budget=budget, compile=compile, numerics=Numerics[numerics.upper()])
    calibrate_s = None
    if budget is not None:
        t0 = time.perf_counter()
        budget.costs = dec.calibrate(1, [prompts[0].shape[1] + new_tokens])
        calibrate_s = time.perf_counter() - t0
    dec.generate(prompts[0], 8, eos_token_id=[])  # warm-up: kernel compilation (torch.compile too), graph capture
    tree_rows = 0 if drafter is None else dec.tree.num_nodes
    cache = dec._cache
    per_row = cache.kv[:, :, 0, 0].numel() * cache.kv.element_size()  # one row of K and V over all layers
    draft_bytes = drafter.nbytes() if hasattr(drafter, "nbytes") else 0
    results = {}
    for temperature in temperatures:
        emitted = forwards = 0
        seconds = capture = 0.0
        outputs, lengths, nodes, per_prompt, options = [], [], [], [], Counter()
        graphs_before = _compiled_graphs()
        for i, ids in enumerate(prompts):
            _sync(device)
            out = dec.generate(ids, new_tokens, temperature=temperature, seed=i, eos_token_id=[])
            _sync(device)
            per_prompt.append(out.stats.time_decode - out.stats.time_capture)
            seconds += out.stats.time_decode - out.stats.time_capture  # steady decoding: no graph capture
            capture += out.stats.time_capture
            emitted += sum(sum(a) for a in out.accept_lengths)
            forwards += sum(len(a) for a in out.accept_lengths)
            lengths += out.accept_lengths
            nodes += out.stats.nodes_per_round
            options.update(out.stats.option_per_round)
            outputs.append(out.sequences[:, ids.shape[1]:])
        hist = accept_histogram(lengths)
        results[temperature] = {
            "tau": emitted / max(1, forwards), "tokens_per_s": emitted / seconds,
            "capture_ms_per_call": 1e3 * capture / len(prompts), "calibrate_s": calibrate_s,
            "nodes_per_round": sum(nodes) / len(nodes) if nodes else None, "draft_bytes": draft_bytes,
            "tree_scratch_bytes": tree_rows * per_row, "accept_hist": hist,
            # where a slow cell's time went: each prompt's decode seconds, and graphs torch.compile made in the
            # timed calls (0 after the warm-up unless something recompiled)
            "decode_s_per_prompt": per_prompt, "compiled_in_timed_calls": _compiled_graphs() - graphs_before,
            "accept_by_depth": accept_by_depth(hist, dec.tree.depth) if drafter is not None else None,
            # an adaptive budget's rounds per chosen option and the costs it chose by (CostModel.to_json), so a slow
            # cell can be replayed on a CPU (benchmarks.replay_adaptive --costs) without another device call
            "options": dict(options.most_common()) if budget is not None else None,
            "costs": budget.costs.to_json() if budget is not None else None,
            **_peak(device, start), "outputs": outputs}
    del dec, drafter
    return results


def run_hf(pair: Pair, prompts, new_tokens: int, temperature: float, device: str) -> dict:
    """transformers' own generate with eager attention; decode time = generate(n) - generate(1) per prompt. Out of
    GPU memory (eager attention holds a context x context score matrix per head at the prefill), the result says
    so instead."""
    target = pair.target
    previous = target.config._attn_implementation
    target.set_attn_implementation("eager")
    kw = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=None,
              top_p=None, eos_token_id=None, pad_token_id=0)
    start = _reset_peak(device)
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
    except torch.OutOfMemoryError as err:
        seq = None
        torch.cuda.empty_cache()
        return {"tau": None, "tokens_per_s": None, "draft_bytes": 0, "tree_scratch_bytes": 0, "accept_hist": None,
                "accept_by_depth": None, "peak_bytes": None, "peak_extra_bytes": None, "outputs": None,
                "error": "out of memory: " + str(err).splitlines()[0][:160]}
    finally:
        target.set_attn_implementation(previous)
    return {"tau": 1.0, "tokens_per_s": (new_tokens - 1) * len(prompts) / seconds, "draft_bytes": 0,
            "tree_scratch_bytes": 0, "accept_hist": None, "accept_by_depth": None, **_peak(device, start),
            "outputs": outputs}


def bench(pair: Pair, contexts, n_prompts: int, new_tokens: int, temperatures, device: str, hf: bool,
          on_rows=None, compile: bool = False, only: Optional[Sequence[str]] = None,
          numerics: str = "fast", kinds: Sequence[str] = ("repository",),
          trees: Sequence[tuple[int, ...]] = ()) -> list[dict]:
    """Every method (or those named in ``only``; Vanilla FA always, as the baseline) at every (context,
    temperature), contexts in the order given; ``on_rows(rows)`` is called after each context (so a run cut short
    keeps what it measured). ``compile``: the decoders' ``compile=True`` (compiled in each method's warm-up);
    ``numerics``: their :class:`~longspec.Numerics`, by name; ``kinds``: the prompt kinds, each its own rows;
    ``trees``: more LongSpec tree shapes (:func:`methods`)."""
    rows = []
    for ctx, kind in [(c, k) for c in contexts for k in kinds]:
        prompts, packages = heldout_prompts(pair.heldout, pair.tokenizer, ctx, n_prompts, seed=ctx, kind=kind)
        prompts = [p.to(device) for p in prompts]
        results = {t: {} for t in temperatures}
        if hf:
            for temperature in temperatures:
                results[temperature][VANILLA_HF] = run_hf(pair, prompts, new_tokens, temperature, device)
        for name, (factory, shape, budget_factory) in methods(pair, trees).items():
            if only and name != VANILLA_FA and name not in only:
                continue
            for temperature, r in run_engine(pair, factory, shape, budget_factory, prompts, new_tokens, temperatures,
                                             device, compile, numerics).items():
                results[temperature][name] = r
        for temperature in temperatures:
            base = results[temperature][VANILLA_FA]
            base_outputs = base["outputs"]
            for name, r in results[temperature].items():
                outputs = r.pop("outputs")
                if outputs is None:  # it did not run (out of memory)
                    same, first = None, None
                else:
                    diffs = [d for d in (first_difference(a, b) for a, b in zip(outputs, base_outputs))
                             if d is not None]
                    same, first = not diffs, (min(diffs) if diffs else None)
                speedup = r["tokens_per_s"] / base["tokens_per_s"] if r["tokens_per_s"] else None
                rows.append({"context": ctx, "prompts": kind, "T": temperature, "method": name, **r,
                             "speedup_vs_FA": speedup,
                             "identical_to_FA": same, "first_difference": first, "packages": packages})
                if r.get("error"):
                    print(f"ctx {ctx:6d} {kind} T {temperature} {name:32s} {r['error']}", flush=True)
                    continue
                peak = f" peak {r['peak_bytes'] / 2**20:.0f} MB" if r["peak_bytes"] is not None else ""
                recompiled = f" COMPILED {r['compiled_in_timed_calls']} graphs in timed calls" \
                    if r.get("compiled_in_timed_calls") else ""
                print(f"ctx {ctx:6d} {kind} T {temperature} {name:32s} tau {r['tau']:.2f} "
                      f"{r['tokens_per_s']:8.1f} tok/s x{speedup:.2f} same={same}{peak}{recompiled}", flush=True)
        if on_rows is not None:
            on_rows(rows)
    return rows


def _mb(x):
    return None if x is None else x / 2**20


COLUMNS = [("context", "context", ""), ("prompts", "prompts", ""), ("T", "T", ""), ("method", "method", ""), ("tau", "tau", ".2f"),
           ("tokens_per_s", "tokens/s", ".1f"), ("speedup_vs_FA", "speedup vs FA", ".2f"),
           ("capture_ms_per_call", "graph capture ms/call", ".0f"), ("nodes_per_round", "nodes/round", ".1f"),
           ("peak_mb", "peak MB", ".0f"), ("peak_extra_mb", "peak over start MB", ".0f"),
           ("draft_mb", "draft MB", ".2f"), ("tree_scratch_mb", "tree scratch MB", ".2f"),
           ("depth_acceptance", "accepted by depth", ""), ("identical_to_FA", "same as FA", ""),
           ("identical_fp32", "same as FA, float32", "")]


def write_results(rows: list[dict], meta: dict, out_dir: str | None, env: dict | None = None,
                  suite: str = "e2e") -> None:
    """<suite>.json / .md (rows by context and temperature, methods in their order) and .png."""
    rows = sorted(rows, key=lambda r: (r["context"], _kind(r), r["T"]))  # stable: methods keep their order
    table = [{**r, "draft_mb": r["draft_bytes"] / 2**20, "tree_scratch_mb": r["tree_scratch_bytes"] / 2**20,
              "peak_mb": _mb(r.get("peak_bytes")), "peak_extra_mb": _mb(r.get("peak_extra_bytes")),
              "depth_acceptance": "/".join(f"{a:.2f}" for a in r["accept_by_depth"])
              if r.get("accept_by_depth") else "",
              "identical_fp32": r.get("identical_fp32", "")} for r in rows]
    write_results_files(suite, table, out_dir, meta=meta, title="Long-code completion, end to end", columns=COLUMNS,
                        env=env, notes=["tau / decode tokens/s (prefill and graph capture excluded) / speedup over "
                                        "Vanilla FA; peak "
                                        "memory is everything allocated on the GPU during the method's run (weights "
                                        "included) and its rise over the start; accepted by depth: the fraction of "
                                        "rounds whose depth-d draft was accepted; `python -m benchmarks.bench_e2e`"],
                        plot=plot_results)


def merge_results(paths: list[str]) -> tuple[list[dict], dict, dict]:
    """Rows of several e2e.json files (a run split over device calls): a later file's row replaces an earlier one
    with the same (context, T, method). Returns (rows, meta, environment) with the first file's environment and
    every file's meta under ``meta["merged"]``."""
    rows: dict[tuple, dict] = {}
    metas, env = [], None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        env = env or data.get("environment")
        metas.append({"file": os.path.basename(os.path.dirname(os.path.abspath(path))) + "/" +
                      os.path.basename(path), **data.get("meta", {}),
                      "git_sha": data.get("environment", {}).get("git_sha")})
        for r in data["rows"]:
            rows[_key(r)] = r
    return list(rows.values()), {"merged": metas}, env or {}


def plot_results(rows: list[dict], out_path) -> None:
    """tau, speedup over Vanilla FA and peak memory against context, one column per temperature (needs
    matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = _kind(rows[0]) if rows else None
    rows = [r for r in rows if _kind(r) == first]
    temps = sorted({r["T"] for r in rows})
    names = list(dict.fromkeys(r["method"] for r in rows))
    panels = [("tau", "tau (tokens per target forward)"), ("speedup_vs_FA", "decode tokens/s over Vanilla FA"),
              ("peak_bytes", "peak GPU memory, GiB")]
    fig, axes = plt.subplots(len(panels), len(temps), figsize=(6 * len(temps), 4 * len(panels)), squeeze=False)
    for j, temperature in enumerate(temps):
        for m in names:
            for i, (key, _) in enumerate(panels):
                pts = sorted((r["context"], r[key]) for r in rows
                             if r["method"] == m and r["T"] == temperature and r.get(key) is not None)
                if key != "peak_bytes" and m == VANILLA_FA or not pts:
                    continue
                scale = 2**30 if key == "peak_bytes" else 1
                axes[i][j].plot([p[0] for p in pts], [p[1] / scale for p in pts], marker="o", label=m)
        for i, (key, title) in enumerate(panels):
            axes[i][j].set_title(f"T = {temperature}: {title}")
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_xlabel("prompt tokens")
            axes[i][j].grid(alpha=0.3)
        axes[1][j].axhline(1.0, color="gray", lw=0.8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def annotate_fp32(rows: list[dict], fp32_rows: list[dict]) -> None:
    """Set ``identical_fp32`` on every row that the float32 check also ran (same context, T and method)."""
    same = {_key(r): r["identical_to_FA"] for r in fp32_rows}
    for r in rows:
        if _key(r) in same:
            r["identical_fp32"] = same[_key(r)]


def _kind(row: dict) -> str:
    return row.get("prompts", "repository")  # rows of runs before prompt kinds existed are repository prompts


def _key(row: dict) -> tuple:
    """What identifies a row across runs: (context, prompt kind, T, method)."""
    return row["context"], _kind(row), row["T"], row["method"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def check_contexts(pair_dir: str, contexts, new_tokens: int, flag: str = "--contexts") -> None:
    """Refuse, before any weight is loaded, a context whose prompt plus generation exceeds the target's positions."""
    with open(os.path.join(pair_dir, "target", "config.json")) as f:
        limit = json.load(f).get("max_position_embeddings")
    too_long = [c for c in contexts if limit is not None and c + new_tokens > limit]
    if too_long:
        raise ValueError(f"{flag} {' '.join(map(str, too_long))}: a prompt of that many tokens plus --new-tokens "
                         f"{new_tokens} exceeds the target's max_position_embeddings ({limit})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", help="recipe output directory")
    ap.add_argument("--heldout", default=None, metavar="JSONL",
                    help="held-out split (needed with an exported pair, e.g. longspec/assets/code-pair)")
    ap.add_argument("--replot", metavar="E2E_JSON", help="only redraw e2e.png from an earlier run's e2e.json")
    ap.add_argument("--merge", nargs="+", metavar="E2E_JSON",
                    help="only combine the rows of runs split over several device calls into --out")
    ap.add_argument("--contexts", type=_positive, nargs="+", default=[4096, 8192, 16384, 32768, 65536],
                    help="prompt lengths, run in this order (put the ones that matter most first)")
    ap.add_argument("--prompts", type=_positive, default=4)
    ap.add_argument("--prompt-kinds", nargs="+", choices=PROMPT_KINDS, default=["repository"],
                    help="held-out prompt kinds, each its own rows (see longspec.train.corpus.heldout_prompts)")
    ap.add_argument("--new-tokens", type=_positive, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--no-hf", action="store_true", help="skip Vanilla HF (slow at long context)")
    ap.add_argument("--fp32-check", type=_positive, nargs="+", default=[], metavar="CONTEXT",
                    help="then decode one prompt per context and kind in float32 with the same methods (--methods) and "
                         "record whether each output equals Vanilla FA's (identical_fp32; e2e_fp32.json, written "
                         "after each context)")
    ap.add_argument("--fp32-new-tokens", type=_positive, default=64)
    ap.add_argument("--compile", action="store_true",
                    help="decoders with compile=True (torch.compile of the target's layers, the drafters' propose "
                         "and the tail; compiled in each method's warm-up, not timed)")
    ap.add_argument("--methods", nargs="+", metavar="NAME",
                    help="only these engine methods (by row name; Vanilla FA always runs as the baseline)")
    ap.add_argument("--trees", type=tree_shape, nargs="+", default=[], metavar="SHAPE",
                    help="more LongSpec tree shapes (e.g. 4-12-12-12-12), each a row 'LongSpec tree SHAPE' beside the "
                         "default 4-16-16-16-16 ('LongSpec tree')")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--numerics", choices=("fast", "invariant"), default="fast",
                    help="every engine method's numerics (longspec.Numerics); invariant: speculative output equals "
                         "Vanilla FA's bit for bit in bf16 too (issue 22)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    a = ap.parse_args(argv)
    if a.replot:
        with open(a.replot) as f:
            plot_results(json.load(f)["rows"], os.path.join(os.path.dirname(a.replot), "e2e.png"))
        return
    if a.merge:
        rows, meta, env = merge_results(a.merge)
        write_results(rows, meta, a.out, env=env)
        return
    if not a.pair:
        ap.error("--pair is required (or --replot / --merge)")
    exported = os.path.isfile(os.path.join(a.pair, "pair.json"))
    if not os.path.isfile(os.path.join(a.pair, "recipe.json")) and not exported:
        ap.error(f"argument --pair: {a.pair!r} holds neither recipe.json (the directory the recipe wrote) nor "
                 "pair.json (an exported pair)")
    if a.heldout is None and not os.path.isfile(os.path.join(a.pair, "recipe.json")):
        ap.error(f"argument --heldout: an exported pair ({a.pair}) needs the held-out split's jsonl "
                 "(longspec.train.corpus.build_corpus(DIR, splits=('heldout',)) writes DIR/heldout.jsonl)")
    if a.heldout is not None and not os.path.isfile(a.heldout):
        ap.error(f"argument --heldout: {a.heldout!r} is not a file")
    try:
        check_contexts(a.pair, a.contexts, a.new_tokens)
        check_contexts(a.pair, a.fp32_check, a.fp32_new_tokens, "--fp32-check")
    except ValueError as err:
        ap.error(str(err))
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    pair = load_pair(a.pair, a.device, dtype, a.heldout)
    names = set(methods(pair, a.trees)) - {VANILLA_FA}
    if a.methods and not set(a.methods) <= names:
        ap.error(f"argument --methods: unknown {sorted(set(a.methods) - names)}; the methods are {sorted(names)}")
    meta = {"device": a.device, "dtype": str(dtype), "prompts_per_context": a.prompts, "new_tokens": a.new_tokens,
            "compile": a.compile, "numerics": a.numerics, "prompt_kinds": a.prompt_kinds}
    with torch.inference_mode():
        rows = bench(pair, a.contexts, a.prompts, a.new_tokens, a.temperatures, a.device, hf=not a.no_hf,
                     on_rows=lambda rows: write_results(rows, meta, a.out), compile=a.compile, only=a.methods,
                     numerics=a.numerics, kinds=a.prompt_kinds, trees=a.trees)
    if a.fp32_check:
        del pair
        pair32 = load_pair(a.pair, a.device, torch.float32, a.heldout)
        meta32 = {**meta, "dtype": str(torch.float32), "prompts_per_context": 1, "new_tokens": a.fp32_new_tokens}
        with torch.inference_mode():
            fp32_rows = bench(pair32, a.fp32_check, 1, a.fp32_new_tokens, a.temperatures, a.device, hf=False,
                              on_rows=lambda rows: write_results(rows, meta32, a.out, suite="e2e_fp32"),
                              only=a.methods, kinds=a.prompt_kinds, trees=a.trees)
        write_results(fp32_rows, meta32, a.out, suite="e2e_fp32")
        annotate_fp32(rows, fp32_rows)
        write_results(rows, {**meta, "fp32_check": {"contexts": a.fp32_check, "new_tokens": a.fp32_new_tokens}},
                      a.out)


if __name__ == "__main__":
    main()
