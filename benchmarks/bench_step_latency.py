"""Round cost at real model sizes (issue 17): every step of a round against its floors, measured in one run.

For each model and committed length N (batch 1, bf16, CUDA graphs, median of several timed blocks of rounds), with
the target's layers, the draft's ``propose`` and the round's tail compiled (``compile=True``) and, for comparison,
not (``--compile both``):

* **decode**: a plain decoding round (the decode forward, then its tail: the draw and the state update);
* **verify**: the target forward over the 69-node 4-16-16-16-16 tree (``hybrid_tree_attn``);
* **draft**: the LongSpec draft's ``propose`` (5 levels of the one-block draft), with the full LM head and with a
  reduced drafting vocabulary (``--draft-vocab``, the most frequent tokens; here of random counts, since the cost
  does not depend on which tokens);
* **accept**: the tail after a verify (draws at every node, acceptance, stops, ``commit_kv_``, state update);
* **round**: draft + verify + accept as ``generate`` runs them (wall time; its host enqueues the next round before
  it waits for the last, one wait per round).

Floors, timed in the same process: every ``nn.Linear`` of the target (LM head included) at M = 1 and at M = 69 in
one CUDA graph; the layers' attention kernels (``prefix_attn`` at M = 1, ``hybrid_tree_attn`` at the tree's
M = 69) over each layer's own cache, in one graph; and the bytes a step must read (weights + the committed K/V)
over the copy bandwidth measured here. The ratios the issue sets targets for are
decode / (linears@1 + decode attention), verify / (linears@69 + hybrid attention) and round / decode.

No prefill runs: :meth:`~longspec.SpeculativeDecoder.synthetic_run` fills the cache with random K/V and sets the
committed length, which is all the step kernels read. Configurations are the published ones with
``max_position_embeddings`` raised to 262144 (as in the long-context variants LongSpec used); weights are random,
which changes no step's cost (:func:`longspec.testing.published_target`). ``--models pair`` times the shipped
trained pair (``longspec.pretrained``).

Usage (GPU): ``python -m benchmarks.bench_step_latency --models Llama-3-8B Qwen2.5-32B pair --contexts 8192 32768``.
``--numerics both`` adds rows for ``Numerics.INVARIANT`` (issue 22) beside the fast ones, with their round and
decode costs over the fast row's (``round vs fast``).

**Adaptive and merged rounds** (issue 19, ``--adaptive``): per model and N, the rounds of the fixed PLD chains (6
and 16 drafts) and of :mod:`benchmarks.bench_adaptive`'s adaptive merged decoder (the LongSpec tree + a PLD chain of
16 in one pool, its :class:`~longspec.AdaptiveBudget`) forced to each of a few of its options: plain, PLD alone
(whole, depth 6, depth 3), LongSpec alone (whole, 48 nodes), both merged (whole: 85 nodes, 48, 16).
Each row: the phases, the round's wall time with the adaptive host work (the sync reads the tail's report and
:meth:`~longspec.AdaptiveBudget.choose` runs on flat costs: its host time, not its choice), round / decode and the
round over the same-sized fixed drafter's (the PLD chain of 16 or of 6 for a PLD option, the 69-node tree for the
rest).
Written to ``step_latency_adaptive.{json,md}``.

**Tensor-parallel targets** (issue 23): ``torchrun --nproc-per-node K -m benchmarks.bench_step_latency --tp ...``
shards the random target over K GPUs with transformers' tensor-parallel plan
(:func:`longspec.testing.random_tensor_parallel`: no checkpoint, each rank allocates only its shards, so the
Qwen2.5-72B shape runs on 2-4 H200s); the draft is replicated. Every rank runs the rounds; rank 0 writes
``step_latency_tp<K>.{json,md}``. The per-GPU floors (linears, attention kernels) are not timed under ``--tp``
(their weights are DTensors), so those rows carry the phases, the round and the bytes one rank reads. Compare with
the 1-GPU rows of the same model (Qwen2.5-32B fits one H200). NOT YET RUN ON GPUs: written and smoke-tested on CPU
only (the TP decode path itself is tested on CPU with gloo); CUDA graphs and ``compile`` over NCCL collectives are
untried, hence ``--cuda-graphs off`` as the fallback.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Sequence

import torch

from benchmarks.bench_step_adaptive import ADAPTIVE_COLUMNS, ADAPTIVE_NOTES, measure_adaptive
from benchmarks.harness import environment, results_dir, tree_shape, write_results
from benchmarks.step_parts import (TREE, local_bytes, attention_floor_us, draft_floor_us, linear_floor_us,
                                   profile_draft, round_times, target_and_draft)
from benchmarks.timing import measure_peaks
from longspec.testing import PUBLISHED_CONFIGS

def measure(name: str, contexts: list[int], compiles: list[bool], draft_vocab: int, iters: int, peaks: dict,
            on_row=lambda row: None, tp: bool = False, cuda_graphs: bool = True, device: str = "cuda",
            numerics: tuple[str, ...] = ("fast",), trees: Sequence[tuple[int, ...]] = (TREE,), profile=None,
            fp8: bool = False, mlp_ratio: float = 1.0, cross_blocks: int = 0) -> list:
    """One row per (compile, numerics, context) for the first tree, and per other tree at the longest context.
    ``profile``: a callable taking (model, context, kernel
    table) of the first tree's draft step with the reduced vocabulary (the full one without it), for every context
    of the compiled fast rows. ``fp8``: also the draft with float8 weight copies (full and reduced vocabulary).
    ``mlp_ratio``: a published shape's draft MLP at this many times the target's units; ``cross_blocks``: its
    extra cross-attention blocks."""
    from longspec import LongSpecDrafter, Numerics, SpeculativeDecoder
    from longspec.model.draft import frequent_tokens

    target, draft = target_and_draft(name, device, tp, mlp_ratio, cross_blocks)
    vocab = target.get_output_embeddings().weight.shape[0]
    reduced = None
    if 0 < draft_vocab < vocab:
        counts = torch.randint(0, 1 << 20, (vocab,), generator=torch.Generator().manual_seed(0))
        reduced = frequent_tokens(counts, draft_vocab)
    weights = sum(local_bytes(p) for p in target.parameters())  # this rank's share under --tp
    rows = []
    for compile, mode in [(c, n) for c in compiles for n in numerics]:
        num = Numerics[mode.upper()]
        plain = SpeculativeDecoder(target, None, cuda_graphs=cuda_graphs, compile=compile, numerics=num)
        specs = {t: SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=t, cuda_graphs=cuda_graphs,
                                       compile=compile, numerics=num) for t in trees}
        for context in contexts:
            draft.set_draft_vocab(None)
            d = round_times(plain, context, iters)
            for tree, spec in specs.items():
                if tree != trees[0] and context != max(contexts):
                    continue  # other trees are priced at the longest context only
                row = _tree_row(name, context, compile, mode, tree, d, spec, draft, target, reduced, iters, peaks,
                                weights, cuda_graphs, tp, profile if tree == trees[0] else None, fp8)
                row["draft_intermediate"] = draft.config.intermediate_size
                _ratios(row)
                _versus_fast(row, rows)
                rows.append(row)
                on_row(row)
                if _main_rank():
                    print(json.dumps(row), flush=True)
        del plain, specs
        torch.cuda.empty_cache()
    draft.set_draft_vocab(None)
    return rows


def _tree_row(name, context, compile, mode, tree, d, spec, draft, target, reduced, iters, peaks, weights,
              cuda_graphs, tp, profile, fp8=False) -> dict:
    """One row: the LongSpec round of ``tree`` (full and reduced drafting vocabulary, and with ``fp8`` both again
    drafting from float8 weight copies) beside the plain round ``d``, with the draft, decode and verify floors."""
    from longspec import LongSpecDrafter, Numerics, SpeculativeDecoder

    vocab = target.get_output_embeddings().weight.shape[0]
    T = spec.tree.num_nodes
    s = round_times(spec, context, iters)
    row = {"model": name, "context": context, "compile": compile, "numerics": mode, "tree": "-".join(map(str, tree)),
           "nodes": T, "gpus": spec.tp.world if spec.tp else 1, "cuda_graphs": cuda_graphs,
           "decode_us": d["phases_us"]["verify"] + d["phases_us"]["accept"],
           "decode_forward_us": d["phases_us"]["verify"], "decode_wall_us": d["round_wall_us"],
           "verify_us": s["phases_us"]["verify"], "draft_us": s["phases_us"]["draft"],
           "accept_us": s["phases_us"]["accept"], "round_wall_us": s["round_wall_us"],
           "first_round_decode_s": d["first_round_s"], "first_round_spec_s": s["first_round_s"],
           "decode_phase_drift": _drift(d), "phase_drift": _drift(s)}
    profiling = profile is not None and compile and mode == "fast"
    if reduced is None and profiling:
        profile(name, context, profile_draft(spec, context))
    bw = peaks["copy_bytes_per_s"]
    variants = [("reduced", reduced, None)] if reduced is not None else []
    if fp8:
        variants += [("fp8", None, torch.float8_e4m3fn)] + (
            [("fp8_reduced", reduced, torch.float8_e4m3fn)] if reduced is not None else [])
    for key, vocab_ids, weight_dtype in variants:
        draft.set_draft_vocab(vocab_ids)
        spec_r = SpeculativeDecoder(target, LongSpecDrafter(draft, weight_dtype=weight_dtype), tree_shape=tree,
                                    cuda_graphs=cuda_graphs, compile=compile, numerics=Numerics[mode.upper()])
        r = round_times(spec_r, context, iters)
        if profiling:  # every drafting variant: the float8 full-vocabulary one has its own target (issue 32)
            label = f"{name}{' fp8' if weight_dtype else ''}{' full vocabulary' if vocab_ids is None else ''}"
            profile(label, context, profile_draft(spec_r, context))
        if vocab_ids is not None:
            row["draft_vocab"] = vocab_ids.numel()
        row[f"draft_{key}_us"] = r["phases_us"]["draft"]
        row[f"round_{key}_wall_us"] = r["round_wall_us"]
        row[f"phase_drift_{key}"] = _drift(r)
        rows_read = vocab if vocab_ids is None else vocab_ids.numel()
        row[f"draft_{key}_floor_us"] = draft_floor_us(draft, target, context, len(tree), rows_read, bw,
                                                      fp8=weight_dtype is not None)
        row[f"draft_{key}_vs_floor"] = row[f"draft_{key}_us"] / row[f"draft_{key}_floor_us"]
        del spec_r
        draft.set_draft_vocab(None)
        draft.pack_for_drafting()  # drop the float8 copies (the next decoder packs what it needs)
    row["round_us"] = row["draft_us"] + row["verify_us"] + row["accept_us"]
    row["draft_floor_us"] = draft_floor_us(draft, target, context, len(tree), vocab, bw)
    row["draft_vs_floor"] = row["draft_us"] / row["draft_floor_us"]
    cache = s["run"].state.cache
    kv_bytes = cache.kv[:, :, :, :context].numel() * cache.kv.element_size()
    row["bytes_floor_us"] = (weights + kv_bytes) / bw * 1e6
    if not tp and mode == "fast":  # the floors are cuBLAS and the fast kernels: timed once per row
        row["linears_m1_us"] = linear_floor_us(target, 1, iters)
        row["linears_mT_us"] = linear_floor_us(target, T, iters)
        row["attn_decode_us"] = attention_floor_us(d["run"], context, 1, iters)
        row["attn_verify_us"] = attention_floor_us(s["run"], context, T, iters)
        row["attn_verify_layer_us"] = row["attn_verify_us"] / target.config.get_text_config().num_hidden_layers
    return row


def _drift(times: dict) -> float:
    """The phases timed after the wall loop over those timed before it, less 1 (:func:`round_times`): near 0 when
    the device kept its pace; the wall round's excess over the phases, when this is near 0, is idle time."""
    return sum(times["phases_after_us"].values()) / sum(times["phases_us"].values()) - 1


def _versus_fast(row: dict, rows: list[dict]) -> None:
    """An invariant row's costs over the fast row of the same model, context and compile setting (issue 22's
    target: round <= 1.2x)."""
    fast = next((r for r in rows if r["numerics"] == "fast" and r["model"] == row["model"]
                 and r["context"] == row["context"] and r["compile"] == row["compile"]
                 and r.get("tree") == row.get("tree")), None)
    if row["numerics"] == "fast" or fast is None:
        return
    for key in ("round_wall_us", "decode_wall_us", "verify_us", "decode_us"):
        row[key.replace("_us", "") + "_vs_fast"] = row[key] / fast[key]


def _main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _ratios(row: dict) -> None:
    row["round_per_decode"] = row["round_wall_us"] / row["decode_wall_us"]
    for key in ("reduced", "fp8", "fp8_reduced"):
        if f"round_{key}_wall_us" in row:
            row[f"round_{key}_per_decode"] = row[f"round_{key}_wall_us"] / row["decode_wall_us"]
    if "linears_m1_us" not in row:  # --tp: no per-GPU floors
        return
    row["decode_floor_us"] = row["linears_m1_us"] + row["attn_decode_us"]
    row["verify_floor_us"] = row["linears_mT_us"] + row["attn_verify_us"]
    row["decode_vs_floor"] = row["decode_us"] / row["decode_floor_us"]
    row["verify_vs_floor"] = row["verify_us"] / row["verify_floor_us"]


COLUMNS = [("model", "model", ""), ("gpus", "GPUs", ""), ("context", "N", ""), ("compile", "compile", ""),
           ("numerics", "numerics", ""), ("tree", "tree", ""),
           ("decode_us", "decode", ".0f"), ("decode_floor_us", "floor", ".0f"), ("decode_vs_floor", "x", ".2f"),
           ("verify_us", "verify", ".0f"), ("verify_floor_us", "floor", ".0f"), ("verify_vs_floor", "x", ".2f"),
           ("draft_us", "draft", ".0f"), ("draft_floor_us", "floor", ".0f"), ("draft_vs_floor", "x", ".2f"),
           ("draft_reduced_us", "draft (reduced)", ".0f"), ("draft_reduced_floor_us", "floor", ".0f"),
           ("draft_reduced_vs_floor", "x", ".2f"),
           ("draft_fp8_us", "draft fp8", ".0f"), ("draft_fp8_floor_us", "floor", ".0f"),
           ("draft_fp8_vs_floor", "x", ".2f"),
           ("draft_fp8_reduced_us", "draft fp8 (reduced)", ".0f"), ("draft_fp8_reduced_floor_us", "floor", ".0f"),
           ("draft_fp8_reduced_vs_floor", "x", ".2f"), ("accept_us", "accept", ".0f"),
           ("round_wall_us", "round", ".0f"), ("round_per_decode", "round/decode", ".2f"),
           ("round_reduced_per_decode", "reduced round/decode", ".2f"),
           ("round_fp8_per_decode", "fp8 round/decode", ".2f"),
           ("round_fp8_reduced_per_decode", "fp8 reduced round/decode", ".2f"),
           ("first_round_spec_s", "first round s", ".1f"),
           ("round_wall_vs_fast", "round vs fast", ".2f"), ("decode_wall_vs_fast", "decode vs fast", ".2f")]
NOTES = ["Random weights, bf16, batch 1, CUDA graphs; times in us. decode = a plain round (forward + tail); round = "
         "draft + verify + accept as generate runs them (wall; the host one round ahead, one wait per round); floors: every linear of the model plus the layers' "
         "attention kernels, timed in this run. `python -m benchmarks.bench_step_latency`",
         "GPUs > 1: the target tensor-parallel over them (`torchrun --nproc-per-node K -m benchmarks.bench_step_latency "
         "--tp`), the draft replicated; per-GPU floors are not timed there (blank), and bytes_floor is one rank's "
         "weights and cache.",
         "numerics invariant: the batch-invariant kernels (`Numerics.INVARIANT`, `--numerics both`); its rows carry "
         "no floors and compare with the fast row of the same model, N and compile setting (issue 22: round vs "
         "fast <= 1.2)."]


def write(rows: list[dict], meta: dict, out_dir: str, plot: bool = True, suite: str = "step_latency",
          taus: Optional[dict] = None):
    columns = COLUMNS + (TREE_COLUMNS if add_tree_tau(rows, meta, taus) else [])
    return write_results(suite, rows, out_dir, meta=meta, title="Round cost at real sizes", notes=NOTES,
                         columns=columns, plot=_plot if plot else None)


def read_tree_tau(path: Optional[str]) -> Optional[dict]:
    """``benchmarks.tree_tau``'s result (``--tree-tau``), or None."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise SystemExit(f"argument --tree-tau: {path!r} is not a file (benchmarks.tree_tau writes tree_tau.json)")
    return json.loads(open(path).read())


def add_tree_tau(rows: list[dict], meta: dict, taus: Optional[dict]) -> bool:
    """Put each row's tree's tau over the first tree's (``taus``: a tree_tau result, measured on the pair) beside it,
    and the cost per generated token over the first tree's row of the same model, context and compile setting
    (round cost over tau). True when ``taus`` was given."""
    if taus is None:
        return False
    first = taus["rows"][0]["tree"]
    ratio = {t["tree"]: t["tau_vs_first"] for t in taus["rows"]}
    meta["tree tau"] = f"context {taus['meta'].get('context')}, first tree {first}"
    for row in rows:
        if row.get("tree") not in ratio:
            continue
        row["tau_vs_first"] = ratio[row["tree"]]
        base = next((r for r in rows if r["model"] == row["model"] and r["context"] == row["context"]
                     and r["compile"] == row["compile"] and r.get("tree") == first), None)
        key = "round_reduced_per_decode" if "round_reduced_per_decode" in row else "round_per_decode"
        if base is not None:
            row["cost_per_token_vs_first"] = row[key] / base[key] / row["tau_vs_first"]
    return True


def merge(paths: list[str], tree_tau: Optional[str], out: Optional[str]) -> None:
    """One result from several runs' ``step_latency.json`` (rows in the order given; the environment of the first,
    which must share its commit with the others), with ``--tree-tau``'s acceptance beside each tree."""
    runs = [json.loads(open(p).read()) for p in paths]
    shas = {r["environment"].get("git_sha") for r in runs}
    if len(shas) != 1:
        raise SystemExit(f"--merge: the runs come from different commits {sorted(shas)}")
    rows = [row for r in runs for row in r["rows"]]
    meta = {}
    for r in runs:  # a key whose runs disagree (trees, copy TB/s) lists each distinct value
        for k, v in r["meta"].items():
            meta.setdefault(k, []).append(str(v))
    meta = {k: " / ".join(dict.fromkeys(v)) for k, v in meta.items()}
    columns = COLUMNS + (TREE_COLUMNS if add_tree_tau(rows, meta, read_tree_tau(tree_tau)) else [])
    write_results("step_latency", rows, out, meta=meta, title="Round cost at real sizes", notes=NOTES,
                  columns=columns, plot=_plot, env=runs[0]["environment"])
    print((results_dir(out) / "step_latency.md").read_text())


TREE_COLUMNS = [("tau_vs_first", "pair tau / 69-node", ".3f"), ("cost_per_token_vs_first", "cost per token / 69-node",
                                                                  ".3f")]


def _plot(rows: list[dict], path) -> None:
    """Stacked bars per (model, N, compile): a round's draft / verify / accept against the decode step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['context'] // 1024}k {'C' if r['compile'] else 'E'}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4.5))
    bottom = [0.0] * len(rows)
    for key, color in (("draft_us", "tab:orange"), ("verify_us", "tab:blue"), ("accept_us", "tab:green")):
        vals = [r[key] / r["decode_us"] for r in rows]
        ax.bar(x, vals, bottom=bottom, color=color, label=key[:-3])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.4, color="r", lw=0.8, ls="--", label="target 1.4")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("time / decode step")
    ax.set_title("LongSpec round cost in decode steps (C = compiled, E = eager kernels)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _inductor_settings(ap, items: list[str]) -> dict:
    """``KEY=VALUE`` strings -> torch._inductor.config settings, applied now (values parsed by the setting's type)."""
    import torch._inductor.config as inductor_config

    settings = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not hasattr(inductor_config, key):
            ap.error(f"argument --inductor: expected KEY=VALUE with KEY a torch._inductor.config setting, got {item!r}")
        current = getattr(inductor_config, key)
        if isinstance(current, bool):
            if text not in ("True", "False", "1", "0"):
                ap.error(f"argument --inductor: {key} takes True or False, got {text!r}")
            value = text in ("True", "1")
        else:
            try:
                value = type(current)(text) if current is not None else text
            except ValueError:
                ap.error(f"argument --inductor: {key} takes a {type(current).__name__}, got {text!r}")
        setattr(inductor_config, key, value)
        settings[key] = value
    return settings


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    models = sorted(PUBLISHED_CONFIGS)
    ap.add_argument("--models", nargs="+", choices=models + ["pair"], default=["Llama-3-8B", "Qwen2.5-32B"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--compile", choices=("on", "off", "both"), default="both")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="reduced drafting vocabulary (0: none)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    ap.add_argument("--tp", action="store_true", help="under torchrun: the target tensor-parallel over the ranks")
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    ap.add_argument("--trees", nargs="+", default=["-".join(map(str, TREE))], metavar="SHAPE",
                    help="LongSpec trees, nodes per depth dash-separated (default 4-16-16-16-16: 69 nodes with the "
                         "root); the first at every context, the others priced at the longest context")
    ap.add_argument("--numerics", choices=("fast", "invariant", "both"), default="fast",
                    help="the target's numerics (longspec.Numerics); both: fast and invariant rows in one run")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the draft with float8 weight copies (LongSpecDrafter(weight_dtype=float8_e4m3fn)), "
                         "full and reduced vocabulary")
    ap.add_argument("--profile", action="store_true",
                    help="also write draft_profile.txt: torch.profiler's kernel table of the compiled draft step")
    ap.add_argument("--merge", nargs="+", metavar="STEP_LATENCY_JSON",
                    help="no measurement: combine the rows of runs split over several device calls into one result")
    ap.add_argument("--tree-tau", metavar="TREE_TAU_JSON",
                    help="benchmarks.tree_tau's result: each row gets its tree's tau over the first tree's there, "
                         "and its cost per generated token over the first tree's row")
    ap.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                    help="torch._inductor.config settings for every compile of the run (an A/B knob, e.g. "
                         "combo_kernels=True); recorded in the result's meta")
    ap.add_argument("--draft-mlp-ratio", type=float, default=1.0, metavar="R",
                    help="published shapes' drafts with R times the target's MLP units (the price of a widened "
                         "draft); the shipped pair's draft is as trained")
    ap.add_argument("--draft-cross-blocks", type=int, default=0, metavar="K",
                    help="published shapes' drafts with K extra cross-attention + MLP blocks (the price of "
                         "extra_cross_blocks); the shipped pair's draft is as trained")
    ap.add_argument("--adaptive", action="store_true",
                    help="only the adaptive / merged rounds (step_latency_adaptive), not the floors")
    a = ap.parse_args(argv)
    if a.merge:
        merge(a.merge, a.tree_tau, a.out)
        return
    if not a.draft_mlp_ratio > 0:
        ap.error(f"argument --draft-mlp-ratio: must be > 0, got {a.draft_mlp_ratio}")
    if a.draft_cross_blocks < 0:
        ap.error(f"argument --draft-cross-blocks: must be >= 0, got {a.draft_cross_blocks}")
    inductor = _inductor_settings(ap, a.inductor)
    taus = read_tree_tau(a.tree_tau)
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_latency needs a CUDA device")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not a.tp:
        raise SystemExit(f"launched on {world} ranks without --tp: every rank would time its own whole model")
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    torch.cuda.set_device(device)
    compiles = {"on": [True], "off": [False], "both": [True, False]}[a.compile]
    numerics = ("fast", "invariant") if a.numerics == "both" else (a.numerics,)
    if a.adaptive:
        if a.tp:
            raise SystemExit("--adaptive times one GPU")
        if a.trees != ["-".join(map(str, TREE))]:
            ap.error("argument --trees: --adaptive times its own options over the default tree")
        rows = []

        def on_adaptive_row(row):
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_results("step_latency_adaptive", rows, a.out, meta={"tree": "-".join(map(str, TREE))},
                          title="Adaptive and merged rounds", notes=ADAPTIVE_NOTES, columns=ADAPTIVE_COLUMNS)

        for name in a.models:
            measure_adaptive(name, a.contexts, compiles, a.iters, on_adaptive_row, device=device)
            torch.cuda.empty_cache()
        return
    peaks = measure_peaks()
    try:
        trees = [tree_shape(t) for t in a.trees]
    except argparse.ArgumentTypeError as err:
        ap.error(f"argument --trees: {err}")
    meta = {"trees": " ".join(a.trees), "copy TB/s": round(peaks["copy_bytes_per_s"] / 1e12, 2)}
    if a.draft_mlp_ratio != 1.0:
        meta["draft_mlp_ratio"] = a.draft_mlp_ratio
    if a.draft_cross_blocks:
        meta["draft_cross_blocks"] = a.draft_cross_blocks
    if inductor:
        meta["inductor"] = " ".join(f"{k}={v}" for k, v in inductor.items())
    if a.tp:
        meta["tensor_parallel"] = world
    suite = f"step_latency_tp{world}" if a.tp else "step_latency"
    rows = []

    def on_row(row):  # written after every row, so a run cut short keeps what it measured
        rows.append(row)
        if _main_rank():
            write(rows, meta, a.out, plot=False, suite=suite, taus=taus)

    profiles = []

    def on_profile(model, context, table):
        profiles.append(f"## {model}, N = {context}, tree {a.trees[0]}: 10 replays of the captured draft graph\n\n"
                        f"{table}\n")
        if _main_rank():
            out = results_dir(a.out)
            (out / "draft_profile.txt").write_text(f"git {environment()['git_sha']}\n\n" + "\n".join(profiles))

    for name in a.models:
        vocab_size = a.draft_vocab if name != "pair" else min(a.draft_vocab, 2048)
        measure(name, a.contexts, compiles, vocab_size, a.iters, peaks, on_row, tp=a.tp,
                cuda_graphs=a.cuda_graphs == "on", device=device, numerics=numerics, trees=trees,
                profile=on_profile if a.profile else None, fp8=a.fp8, mlp_ratio=a.draft_mlp_ratio,
                cross_blocks=a.draft_cross_blocks)
        torch.cuda.empty_cache()
    if _main_rank():
        print((write(rows, meta, a.out, suite=suite, taus=taus) / f"{suite}.md").read_text(), flush=True)
    if a.tp and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
