"""Context-aware speculation (issue 19), measured in one run: the adaptive merged drafter on the shipped pair, and a
projection of the adaptive budget at Llama-3-8B shapes.

(a) **Shipped pair** (``longspec.pretrained``, bf16, CUDA graphs): held-out repository-completion prompts (the
held-out packages of this interpreter's standard library) at each context, T = 0 and T = 1 (seed-exact), decoded by
plain decoding, prompt lookup (chains of 6 and of 16), the fixed LongSpec tree (4-16-16-16-16), the fixed LongSpec
chain (5) and the adaptive merged drafter (LongSpec tree + PLD chain 16 in one pool, :class:`~longspec.AdaptiveBudget`
with its cost model calibrated on this GPU before the first prompt; its options cut the pool, or either part, to
depth 3 or 6 or none, and prune it to 16 / 32 / 48 nodes or none). Rows: tau, decode tokens/s (prefill excluded),
speedup over plain decoding and over the best fixed method, whether the output equals plain decoding's, and for the
adaptive row the mean nodes per round and the mean predicted vs realised tau.

(b) **Projection at Llama-3-8B shapes** (random weights, bf16). The round costs of every budget option (plain; the
4-16-16-16-16 LongSpec tree cut to depth 3 or whole, pruned to 4..48 nodes or whole) come from
:meth:`~longspec.SpeculativeDecoder.calibrate` at each context and batch, on targets of ``--proj-layers`` layers
(the 32-layer cache at 128k x 16 rows would not fit), extrapolated linearly in the layer count to 32 (saved as a
loadable :class:`~longspec.decode.budget.CostModel`, ``llama3_8b_costs.json``; part (a)'s calibration is saved
beside it as ``pair_costs.json``). Each option's expected tau comes
from the shipped pair: a LongSpec decoder that verifies the whole tree every round, which contains every option, so
every round scores every option by the tau it would have realised (the per-round running mean, averaged over the
decode; T = 0; contexts above the pair's largest use the largest). Projected speedup over plain decoding = tau x plain round / option round; the adaptive
budget picks the option :meth:`~longspec.AdaptiveBudget.choose` picks; the fixed row is the whole 69-node tree.

(c) **Batched, on the shipped pair**: the methods of (a) on ``B`` held-out prompts of ``--batch-context`` tokens
decoded as one batch, for each B of ``--batch-sizes`` (default 4 and 16), T = 0 and T = 1. The adaptive budget
chooses one option per round for the batch (one forward), each row keeping its own best nodes of it.

Usage (GPU, about 6 minutes on one H200): ``python -m benchmarks.bench_adaptive --out RESULTS``.
CPU smoke run (tiny sizes, what the test suite runs): ``python -m benchmarks.bench_adaptive --smoke --out DIR``.
"""
from __future__ import annotations

import argparse
import gc
import os
import sysconfig
import tempfile
import time

import torch

from benchmarks.harness import write_results
from longspec import (AdaptiveBudget, LongSpecDraft, LongSpecDrafter, MergedDrafter, PromptLookupDrafter,
                      SpeculativeDecoder, TreeSpec)
from longspec.decode.budget import CostModel, Exploration, default_options, sampling_key
from longspec.decode.sampling import SamplingParams
from longspec.testing import first_difference, published_target

TREE = (4, 16, 16, 16, 16)
SMOKE_TREE = (2, 2)
PLAIN, PLD, LONGSPEC_TREE, LONGSPEC_CHAIN = "plain", "PLD chain", "LongSpec tree", "LongSpec chain"
PLD_DEEP = "PLD chain 16"
FIXED = (PLD, PLD_DEEP, LONGSPEC_TREE, LONGSPEC_CHAIN)
ADAPTIVE = "adaptive LongSpec+PLD"
# the adaptive merged drafter: the LongSpec tree and a 16-deep PLD chain in one pool, options cut at depths 3, 6 and
# whole, pruned to 16 / 32 / 48 nodes or whole (23 options with the 4-16-16-16-16 tree)
MERGED_PLD, MERGED_BUDGETS, MERGED_DEPTHS = 16, (16, 32, 48), (3, 6)
PROJ_BUDGETS, PROJ_DEPTHS = (4, 8, 16, 32, 48), (3,)  # the projection's options, on the LongSpec tree alone


# --- (a) the shipped pair ---------------------------------------------------------------------------------------------


def pair_prompts(tokenizer, contexts, n: int) -> dict[int, tuple[list[torch.Tensor], list[str]]]:
    """Held-out prompts per context from this interpreter's standard library (the pair's held-out split); a
    context the library cannot fill is left out."""
    from longspec.train.corpus import build_corpus, heldout_prompts

    out = {}
    with tempfile.TemporaryDirectory(prefix="longspec-heldout-") as tmp:
        corpus = build_corpus(tmp, roots=[sysconfig.get_paths()["stdlib"]], heldout_frac=0.1, splits=("heldout",))
        for ctx in contexts:
            try:
                out[ctx] = heldout_prompts(corpus.heldout_jsonl, tokenizer, ctx, n, seed=ctx)
            except ValueError as e:
                print(f"context {ctx}: no held-out prompt ({e})", flush=True)
    return out


def merged_budget(explore: float = 1.0, stats=None) -> AdaptiveBudget:
    return AdaptiveBudget(budgets=MERGED_BUDGETS, depths=MERGED_DEPTHS, explore=explore, stats=stats)


def merged_spec(tree: tuple) -> TreeSpec:
    """The adaptive drafter's pool: the LongSpec tree ``tree`` and a PLD chain of ``MERGED_PLD``."""
    return TreeSpec.merged(tree, (1,) * MERGED_PLD)


def merged_drafter(draft) -> MergedDrafter:
    return MergedDrafter(LongSpecDrafter(draft), PromptLookupDrafter())


def pair_methods(draft, tree: tuple, chain: int, explore: float = 1.0) -> dict[str, tuple]:
    """name -> (drafter factory or None, tree shape, budget factory or None), for a LongSpec tree ``tree``, PLD
    chains of ``chain + 1`` and of 16, and LongSpec chains of ``chain``."""
    return {
        PLAIN: (lambda: None, (1,), None),
        PLD: (PromptLookupDrafter, (1,) * (chain + 1), None),
        PLD_DEEP: (PromptLookupDrafter, (1,) * MERGED_PLD, None),
        LONGSPEC_TREE: (lambda: LongSpecDrafter(draft), tree, None),
        LONGSPEC_CHAIN: (lambda: LongSpecDrafter(draft), (1,) * chain, None),
        ADAPTIVE: (lambda: merged_drafter(draft), merged_spec(tree), lambda: merged_budget(explore)),
    }


def make_decoder(target, factory, shape, budget_factory, cuda: bool, calibrate_at=None, batch: int = 1) -> tuple:
    """(decoder, seconds spent calibrating): the adaptive decoder's costs are measured (at the prompts' batch size)
    before its first prompt."""
    budget = budget_factory() if budget_factory is not None else None
    dec = SpeculativeDecoder(target, factory(), tree_shape=shape, cuda_graphs=cuda, budget=budget)
    seconds = 0.0
    if budget is not None:
        t0 = time.perf_counter()
        budget.costs = dec.calibrate(batch, calibrate_at)
        seconds = time.perf_counter() - t0
    return dec, seconds


def decode_all(dec, prompts, new_tokens: int, temperature: float, device: str) -> dict:
    emitted = forwards = 0
    seconds = capture = 0.0
    outputs, nodes, predicted, realised, options = [], [], [], [], {}
    for i, ids in enumerate(prompts):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out = dec.generate(ids, new_tokens, temperature=temperature, seed=i, eos_token_id=[])
        seconds += out.stats.time_decode - out.stats.time_capture  # steady decoding: no graph capture
        capture += out.stats.time_capture
        emitted += sum(sum(a) for a in out.accept_lengths)
        forwards += sum(len(a) for a in out.accept_lengths)
        outputs.append(out.sequences[:, ids.shape[1]:])
        nodes += out.stats.nodes_per_round
        predicted += out.stats.predicted_tau
        realised += out.stats.realised_tau
        for label in out.stats.option_per_round:
            options[label] = options.get(label, 0) + 1
    row = {"tau": emitted / max(1, forwards), "tokens_per_s": emitted / max(seconds, 1e-9),
           "capture_ms_per_call": 1e3 * capture / len(prompts), "outputs": outputs}
    if predicted:
        row.update(nodes_per_round=sum(nodes) / len(nodes), predicted_tau=sum(predicted) / len(predicted),
                   realised_tau=sum(realised) / len(realised),
                   options=dict(sorted(options.items(), key=lambda kv: -kv[1])))  # rounds per chosen option
    return row


def bench_pair(pair, prompts_by_ctx, new_tokens: int, temperatures, device: str, tree: tuple,
               on_rows=None, explore: float = 1.0) -> tuple[list[dict], CostModel]:
    """Every method at every (context, temperature), one decoder per method for the whole run (warmed up on the
    largest context first, so its cache and graphs serve every prompt). A prompt may be a batch ``[B, S]`` (every
    prompt of the run the same B: the adaptive decoder is calibrated at B). Returns the rows and the adaptive
    decoder's calibrated costs (saved as ``pair_costs.json``, to replay its choices elsewhere)."""
    cuda = device.startswith("cuda")
    contexts = sorted(prompts_by_ctx)
    longest = prompts_by_ctx[contexts[-1]][0][0].to(device)
    decoders, meta = {}, {}
    for name, (factory, shape, budget_factory) in pair_methods(pair.draft, tree, len(tree), explore).items():
        dec, calib_s = make_decoder(pair.target, factory, shape, budget_factory, cuda,
                                    calibrate_at=sorted({contexts[0], contexts[-1]}), batch=longest.shape[0])
        dec.generate(longest, 4, eos_token_id=[])  # warm-up: kernels, graphs, the cache at its largest
        decoders[name] = dec
        if budget_factory is not None:
            meta[f"{name}: options"] = len(dec.budget.options)
            meta[f"{name}: calibration s"] = round(calib_s, 1)
    rows = []
    for ctx in contexts:
        prompts, packages = prompts_by_ctx[ctx]
        prompts = [p.to(device) for p in prompts]
        for temperature in temperatures:
            results = {name: decode_all(dec, prompts, new_tokens, temperature, device)
                       for name, dec in decoders.items()}
            base = results[PLAIN]
            base_outputs = base["outputs"]
            best = max(results[m]["tokens_per_s"] for m in FIXED)
            for name, r in results.items():
                diffs = [d for d in (first_difference(a, b) for a, b in zip(r.pop("outputs"), base_outputs))
                         if d is not None]
                rows.append({"context": ctx, "T": temperature, "method": name, **r,
                             "speedup_vs_plain": r["tokens_per_s"] / base["tokens_per_s"],
                             "vs_best_fixed": r["tokens_per_s"] / best, "identical_to_plain": not diffs,
                             "first_difference": min(diffs) if diffs else None, "packages": packages})
                print(f"ctx {ctx:6d} T {temperature} {name:24s} tau {r['tau']:.2f} {r['tokens_per_s']:8.1f} tok/s "
                      f"x{rows[-1]['speedup_vs_plain']:.2f} vs best fixed x{rows[-1]['vs_best_fixed']:.2f} "
                      f"same={not diffs}", flush=True)
            if on_rows is not None:
                on_rows(rows, meta)
    costs = decoders[ADAPTIVE].budget.costs
    del decoders
    return rows, costs


def proj_budget(costs=None, explore: float = 0.5) -> AdaptiveBudget:
    return AdaptiveBudget(costs, budgets=PROJ_BUDGETS, depths=PROJ_DEPTHS, explore=explore)


def option_taus(pair, prompts_by_ctx, new_tokens: int, device: str, tree: tuple) -> dict[int, list[float]]:
    """Per context: every projection option's realised tau on the shipped pair (T = 0), from a LongSpec decoder
    that verifies the whole tree every round (its costs say so), which scores every option the tree contains."""
    options = default_options(TreeSpec(tree), PROJ_BUDGETS, PROJ_DEPTHS)
    # the whole tree costs least and realises the most (it holds every option's nodes), plain rounds cost double, so
    # the whole tree is always chosen, even where every option realised the same
    whole = TreeSpec(tree).num_nodes
    flat = CostModel({1: {o.nodes: (2000.0 if o.spec is None else 1000.0 + 1e-3 * (whole - o.nodes), 0.0)
                          for o in options}},
                     {1: {o.draft_key: (0.0, 0.0) for o in options}})
    budget = proj_budget(flat, explore=0.0)
    dec = SpeculativeDecoder(pair.target, LongSpecDrafter(pair.draft), tree_shape=tree,
                             cuda_graphs=device.startswith("cuda"), budget=budget)
    out = {}
    for ctx, (prompts, _) in sorted(prompts_by_ctx.items()):
        total, rounds = None, 0

        def streamer(emitted, kept):
            nonlocal total, rounds
            curve = budget.stats_for(sampling_key(SamplingParams()), emitted.device).realised
            total = curve.clone() if total is None else total + curve
            rounds += 1

        for ids in prompts:
            dec.generate(ids.to(device), new_tokens, eos_token_id=[], streamer=streamer)
        out[ctx] = (total / max(rounds, 1)).tolist()
    return out


# --- (b) the projection at Llama-3-8B shapes --------------------------------------------------------------------------


def measure_costs(layers: int, batches, contexts, device: str, reps: int, tree: tuple, overrides: dict) -> CostModel:
    """The projection options' costs on a ``layers``-layer target of Llama-3-8B shapes, every batch."""
    target = published_target("Llama-3-8B", device, num_hidden_layers=layers,
                               dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32, **overrides)
    draft = LongSpecDraft.from_target(target)
    dec = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=tree, cuda_graphs=device.startswith("cuda"),
                             budget=proj_budget())
    costs = CostModel(meta={"layers": layers})
    for batch in batches:
        costs.update(dec.calibrate(batch, contexts, reps=reps))
        print(f"calibrated {layers} layers, batch {batch}", flush=True)
    del dec, draft, target
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return costs


def extrapolate(by_layers: dict[int, CostModel], layers: int) -> CostModel:
    """Each cost line's (a, b) extended linearly in the layer count from the two measured counts to ``layers``."""
    (l1, c1), (l2, c2) = sorted(by_layers.items())[:2]

    def line(p, q):
        return tuple(max(0.0, x + (y - x) / (l2 - l1) * (layers - l1)) for x, y in zip(p, q))

    verify = {b: {n: line(c1.verify[b][n], c2.verify[b][n]) for n in t} for b, t in c2.verify.items()}
    draft = {b: {k: line(c1.draft[b][k], c2.draft[b][k]) for k in t} for b, t in c2.draft.items()}
    return CostModel(verify, draft, {"extrapolated_from_layers": [l1, l2], "layers": layers})


def project(costs: CostModel, taus: dict[int, list[float]], contexts, batches, tree: tuple) -> list[dict]:
    budget = proj_budget(costs, explore=0.0)
    budget.bind(TreeSpec(tree))
    options = budget.options
    plain = next(i for i, o in enumerate(options) if o.spec is None)
    fixed = budget.largest  # the whole tree
    rows = []
    for ctx in contexts:
        near = max([c for c in taus if c <= ctx] or [min(taus)])
        curve = taus[near]
        for batch in batches:
            # no exploration (explore=0): the counts do not matter, the choice is the best rate on these taus
            pick = budget.choose(ctx, batch, curve, [True] * len(options), Exploration([1.0] * len(options), 1.0))
            base = costs.round_us(options[plain], ctx, batch)

            def speedup(i: int) -> float:
                tau = 1.0 if options[i].spec is None else curve[i]
                return tau * base / costs.round_us(options[i], ctx, batch)

            rows.append({"context": ctx, "batch": batch, "tau_from_context": near,
                         "adaptive_option": options[pick].label,
                         "tau_adaptive": 1.0 if pick == plain else curve[pick], "tau_fixed69": curve[fixed],
                         "round_us_fixed69": costs.round_us(options[fixed], ctx, batch), "round_us_plain": base,
                         "speedup_adaptive": speedup(pick), "speedup_fixed69": speedup(fixed),
                         "adaptive_vs_fixed69": speedup(pick) / speedup(fixed)})
    return rows


# --- the run ----------------------------------------------------------------------------------------------------------

PAIR_COLUMNS = [("context", "context", ""), ("T", "T", ""), ("method", "method", ""), ("tau", "tau", ".2f"),
                ("tokens_per_s", "tokens/s", ".1f"), ("capture_ms_per_call", "graph capture ms/call", ".0f"),
                ("speedup_vs_plain", "vs plain", ".2f"),
                ("vs_best_fixed", "vs best fixed", ".2f"), ("nodes_per_round", "nodes/round", ".1f"),
                ("predicted_tau", "predicted tau", ".2f"), ("realised_tau", "realised tau", ".2f"),
                ("identical_to_plain", "same as plain", "")]
BATCH_COLUMNS = [("batch", "batch", "")] + PAIR_COLUMNS
PROJ_COLUMNS = [("context", "context", ""), ("batch", "batch", ""), ("adaptive_option", "adaptive option", ""),
                ("tau_adaptive", "tau (adaptive)", ".2f"), ("tau_fixed69", "tau (69)", ".2f"),
                ("round_us_plain", "plain round us", ".0f"), ("round_us_fixed69", "69-node round us", ".0f"),
                ("speedup_adaptive", "speedup adaptive", ".2f"), ("speedup_fixed69", "speedup 69", ".2f"),
                ("adaptive_vs_fixed69", "adaptive / 69", ".2f")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--proj-contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--proj-batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--proj-layers", type=int, nargs=2, default=[2, 4], help="the two layer counts timed")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds per option, context and batch")
    ap.add_argument("--explore", type=float, default=1.0, help="the adaptive drafter's AdaptiveBudget(explore=)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[4, 16],
                    help="(c) batched decoding on the pair at --batch-context: B held-out prompts in one batch")
    ap.add_argument("--batch-context", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: the code path, not a measurement")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    a = ap.parse_args(argv)
    overrides = {}
    if a.smoke:
        a.device, a.contexts, a.prompts, a.new_tokens = "cpu", [160], 1, 6
        a.proj_contexts, a.proj_batches, a.reps = [256, 512], [1, 2], 1
        a.batch_sizes, a.batch_context = [2], 160
        overrides = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=256, head_dim=16)
    from longspec.pretrained import load_code_pair

    tree = SMOKE_TREE if a.smoke else TREE
    t_start = time.perf_counter()
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    pair = load_code_pair(a.device, dtype)
    meta = {"device": a.device, "dtype": str(dtype), "prompts_per_context": a.prompts, "new_tokens": a.new_tokens,
            "tree": "-".join(map(str, tree)), "explore": a.explore, "smoke": a.smoke}
    with torch.inference_mode():
        prompts = pair_prompts(pair.tokenizer, a.contexts, a.prompts)
    print(f"pair and prompts loaded at {time.perf_counter() - t_start:.0f} s", flush=True)

    def write_pair(rows, extra):
        write_results("adaptive", rows, a.out, meta={**meta, **extra}, columns=PAIR_COLUMNS,
                      title="Adaptive merged drafter on the shipped pair",
                      notes=["tau / decode tokens/s (prefill and CUDA-graph capture excluded; capture per call "
                             "apart); `vs best fixed`: over the best of PLD chain 6, PLD chain 16, "
                             "LongSpec tree and LongSpec chain at that context and T; `python -m "
                             "benchmarks.bench_adaptive`"])

    _, pair_costs = bench_pair(pair, prompts, a.new_tokens, a.temperatures, a.device, tree, on_rows=write_pair,
                               explore=a.explore)
    print(f"(a) done at {time.perf_counter() - t_start:.0f} s", flush=True)
    if a.batch_sizes:
        with torch.inference_mode():
            pool = pair_prompts(pair.tokenizer, [a.batch_context], max(a.batch_sizes))
        batch_rows = []
        for B in a.batch_sizes:
            group, names = pool.get(a.batch_context, ([], []))
            if len(group) < B:
                print(f"batch {B}: only {len(group)} held-out prompts at {a.batch_context}; skipped", flush=True)
                continue
            rows, _ = bench_pair(pair, {a.batch_context: ([torch.cat(group[:B])], names[:B])}, a.new_tokens,
                                 a.temperatures, a.device, tree, explore=a.explore)
            batch_rows += [{"batch": B, **r} for r in rows]
            write_results("adaptive_batch", batch_rows, a.out, meta=meta, columns=BATCH_COLUMNS,
                          title="Adaptive merged drafter on the shipped pair, batched",
                          notes=["B held-out prompts of the same context decoded as one batch; tau per row, "
                                 "tokens/s of the whole batch (prefill and graph capture excluded); `vs best "
                                 "fixed` as in adaptive.md, at the same batch; `python -m benchmarks.bench_adaptive "
                                 "--batch-sizes ...`"])
        print(f"(c) done at {time.perf_counter() - t_start:.0f} s", flush=True)
    taus = option_taus(pair, prompts, a.new_tokens, a.device, tree)
    print(f"option taus done at {time.perf_counter() - t_start:.0f} s", flush=True)
    del pair
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    by_layers = {L: measure_costs(L, a.proj_batches, a.proj_contexts, a.device, a.reps, tree, overrides)
                 for L in a.proj_layers}
    costs = extrapolate(by_layers, 32)
    rows = project(costs, taus, a.proj_contexts, a.proj_batches, tree)
    out_dir = write_results("adaptive_projection", rows, a.out,
                            meta={**meta, "layers_timed": a.proj_layers, "total_s": round(time.perf_counter() - t_start)},
                            columns=PROJ_COLUMNS, title="Adaptive budget vs the fixed tree at Llama-3-8B shapes",
                            notes=["Projected: measured round costs (layers extrapolated to 32), expected tau of every "
                                   "option from the shipped pair's acceptance statistics (T = 0)."])
    costs.save(out_dir / "llama3_8b_costs.json")
    pair_costs.save(out_dir / "pair_costs.json")  # the adaptive drafter's calibration on this device (part a)
    print(f"wrote {out_dir} in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
