"""The adaptive merged decoder's rounds forced to each of a few of its options, beside the fixed drafters' (issue 19):
``python -m benchmarks.bench_step_latency --adaptive`` (see that module), written to ``step_latency_adaptive``."""
from __future__ import annotations

import torch

from benchmarks.step_parts import TREE, round_times, target_and_draft

# the adaptive merged decoder's options timed (bench_adaptive's pool: the LongSpec tree + a PLD chain of 16)
_PLD16 = "-".join(["1"] * 16)
ADAPTIVE_OPTIONS = ["plain", f"none|{_PLD16}/17", "none|1-1-1-1-1-1/7", "none|1-1-1/4", "4-16-16-16-16|none/69",
                    "4-16-16-16-16|none/48", f"4-16-16-16-16|{_PLD16}/85", f"4-16-16-16-16|{_PLD16}/48",
                    f"4-16-16-16-16|{_PLD16}/16"]


def measure_adaptive(name: str, contexts: list[int], compiles: list[bool], iters: int, on_row=lambda row: None,
                     device: str = "cuda") -> list:
    """The fixed PLD chain's round and the adaptive merged decoder's, forced to each of ``ADAPTIVE_OPTIONS``, next
    to the plain round and the fixed 69-node LongSpec tree's (see the module)."""
    from benchmarks.bench_adaptive import merged_budget, merged_drafter, merged_spec
    from longspec import LongSpecDrafter, PromptLookupDrafter, SpeculativeDecoder
    from longspec.decode.budget import CostModel

    target, draft = target_and_draft(name, device)
    chain = (1,) * 6
    rows = []
    for compile in compiles:
        plain = SpeculativeDecoder(target, None, cuda_graphs=True, compile=compile)
        fixed = {"PLD chain 6": SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=chain, cuda_graphs=True,
                                                   compile=compile),
                 "PLD chain 16": SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=(1,) * 16,
                                                    cuda_graphs=True, compile=compile),
                 "LongSpec tree 69": SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=TREE,
                                                        cuda_graphs=True, compile=compile)}
        budget = merged_budget()
        merged = SpeculativeDecoder(target, merged_drafter(draft), tree_shape=merged_spec(TREE), cuda_graphs=True,
                                    compile=compile, budget=budget)
        labels = [o.label for o in budget.options]
        budget.costs = CostModel({1: {o.nodes: (1.0, 0.0) for o in budget.options}},
                                 {1: {o.draft_key: (0.0, 0.0) for o in budget.options}})  # flat: choose's host time
        for context in contexts:
            decode = round_times(plain, context, iters)["round_wall_us"]
            base = {}
            for method, dec in fixed.items():
                t = round_times(dec, context, iters)
                base[method] = t["round_wall_us"]
                rows.append(_adaptive_row(name, context, compile, method, "fixed", dec.tree.num_nodes, t, decode,
                                          t["round_wall_us"]))
                on_row(rows[-1])
            for label in ADAPTIVE_OPTIONS:
                i = labels.index(label)
                t = round_times(merged, context, iters, option=i)
                ref = (base["LongSpec tree 69"] if not label.startswith("none|") else
                       base["PLD chain 16"] if label.startswith(f"none|{_PLD16}") else base["PLD chain 6"])
                rows.append(_adaptive_row(name, context, compile, "adaptive LongSpec+PLD", label,
                                          budget.options[i].nodes, t, decode, ref))
                on_row(rows[-1])
        del plain, fixed, merged
        torch.cuda.empty_cache()
    return rows


def _adaptive_row(model, context, compile, method, option, nodes, t, decode_wall_us, fixed_wall_us) -> dict:
    p = t["phases_us"]
    return {"model": model, "context": context, "compile": compile, "method": method,
            "option": option.replace("|", " + "),  # a merged key's bar would split the markdown table's cell
            "nodes": nodes, "draft_us": p.get("draft", 0.0), "verify_us": p["verify"], "accept_us": p["accept"],
            "round_wall_us": t["round_wall_us"], "decode_wall_us": decode_wall_us,
            "round_per_decode": t["round_wall_us"] / decode_wall_us,
            "round_per_fixed": t["round_wall_us"] / fixed_wall_us}


ADAPTIVE_COLUMNS = [("model", "model", ""), ("context", "N", ""), ("compile", "compile", ""), ("method", "method", ""),
                    ("option", "option", ""), ("nodes", "nodes", ""), ("draft_us", "draft", ".0f"),
                    ("verify_us", "verify", ".0f"), ("accept_us", "accept", ".0f"), ("round_wall_us", "round", ".0f"),
                    ("round_per_decode", "round/decode", ".2f"), ("round_per_fixed", "round/fixed", ".2f")]
ADAPTIVE_NOTES = ["bf16, batch 1, CUDA graphs; times in us; random weights except `pair`. round = draft + verify + "
                  "accept with the host sync (wall; under the budget also the tail's report read and a choice); "
                  "round/fixed: over the fixed PLD chain 16 (the 17-node PLD option), 6 (the other PLD options) or the "
                  "fixed 69-node LongSpec tree (the others). `python -m benchmarks.bench_step_latency --adaptive`"]
