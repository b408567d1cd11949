"""The adaptive merged drafter's choices replayed on the CPU under a GPU cost model: a *model* of tokens/s, not a
measurement.

Every method of :mod:`benchmarks.bench_adaptive` (plain decoding, the PLD chain, the fixed LongSpec tree and chain,
the adaptive LongSpec+PLD drafter) decodes the same held-out prompts of the shipped pair on the CPU in float32, at
T = 0 and T = 1 (seed-exact). The adaptive decoder's budget chooses under a GPU cost model (its ``costs``), so its
choices follow the GPU's costs, not the CPU's. Each method's *modelled* decode time is the sum over its rounds of
the cost model's round time (the adaptive drafter: its chosen option's ``round_us`` at that round's committed
length; a fixed method: its own round line), and modelled tokens/s = generated tokens / that time. The CPU's own
times are not used. Rows: realised tau, modelled tokens/s, the ratio over the best fixed drafter (PLD chains,
LongSpec tree, LongSpec chain, as ``bench_adaptive``), whether the output equals plain decoding's, and for the
adaptive drafter the rounds per chosen option.

Costs. ``--costs FILE``: the adaptive options' :class:`~longspec.decode.budget.CostModel`; default
``benchmarks/results/h200/pair_costs.json``, the calibration ``bench_adaptive`` saved on the H200 (its options must
be this code's). ``--fixed-costs FILE`` (JSON ``{method: [a, b]}``, us = a + b * context): the fixed methods'
rounds; default :data:`FIXED_US`, typed in from ``benchmarks/results/h200/step_latency_adaptive.md`` (the pair, 8k,
``compile=False``; the LongSpec chain, never timed there, scaled from the fixed tree by their ratio in
``adaptive_f8d1efe.md`` in git history) with a context slope from ``step_latency.md``'s plain decode (840 us at 8k, 870 at 32k).
Those are greedy rounds: at T = 1 the adaptive drafter's rounds cost its model's sampled verify times (the cost model
must hold them: ``bench_adaptive`` calibrates them at its first T = 1 call), the fixed methods' do not, so at T = 1
the fixed rows are modelled too fast by the sampled tail's extra cost (160-180 us a round on the H200 at batch 1,
``NOTES.md``).

Usage (about five minutes on two CPU cores): ``python -m benchmarks.replay_adaptive --out DIR``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.bench_adaptive import ADAPTIVE, FIXED, LONGSPEC_CHAIN, LONGSPEC_TREE, PLAIN, PLD, PLD_DEEP, TREE, \
    pair_methods, pair_prompts
from benchmarks.harness import write_results
from longspec import SpeculativeDecoder
from longspec.decode.budget import CostModel, tail_label
from longspec.decode.sampling import SamplingParams
from longspec.testing import first_difference

SLOPE = (870.0 - 840.0) / (32768 - 8192)  # us per committed token: the pair's plain decode, 8k -> 32k (H200)
AT = 8192  # the context of the typed H200 rows
COSTS = Path(__file__).parent / "results" / "h200" / "pair_costs.json"
# fixed methods' rounds at 8k (a, b), step_latency_adaptive.md: plain (the decode the PLD chain's round / decode
# ratio implies), the PLD chains of 6 and 16, the 69-node tree; the LongSpec chain of 5 = the tree's x 2221 / 2632
# (their e2e rounds at 8k, adaptive_f8d1efe.md (git history))
FIXED_US = {PLAIN: (1084.0 / 1.26 - SLOPE * AT, SLOPE), PLD: (1084.0 - SLOPE * AT, SLOPE),
            PLD_DEEP: (1083.0 - SLOPE * AT, SLOPE), LONGSPEC_TREE: (2525.0 - SLOPE * AT, SLOPE),
            LONGSPEC_CHAIN: (2525.0 * 2221 / 2632 - SLOPE * AT, SLOPE)}


def load_fixed(path) -> dict[str, tuple[float, float]]:
    if path is None:
        return dict(FIXED_US)
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or set(data) != {PLAIN, *FIXED} or any(len(v) != 2 for v in data.values()):
        raise ValueError(f"--fixed-costs {path}: expected {{method: [a, b]}} for exactly {[PLAIN, *FIXED]}")
    return {k: (float(a), float(b)) for k, (a, b) in data.items()}


def modelled_us(out, prompt_len: int, round_us) -> float:
    """Sum over the call's rounds of ``round_us(round index, committed length)`` (batch 1)."""
    total, context = 0.0, prompt_len
    for r, n in enumerate(out.accept_lengths[0]):
        total += round_us(r, context)
        context += n
    return total


def decode(dec, name: str, prompts, new_tokens: int, temperature: float, costs: CostModel,
           fixed: dict[str, tuple[float, float]]) -> dict:
    tokens = rounds = 0
    seconds = 0.0
    outputs, options = [], Counter()
    for i, ids in enumerate(prompts):
        out = dec.generate(ids, new_tokens, temperature=temperature, seed=i, eos_token_id=[])
        if name == ADAPTIVE:
            labels = out.stats.option_per_round
            by_label = {o.label: o for o in dec.budget.options}
            tail = tail_label(SamplingParams(temperature=temperature))
            seconds += modelled_us(out, ids.shape[1],
                                   lambda r, c: costs.round_us(by_label[labels[r]], c, 1, tail)) / 1e6
            options.update(labels)
        else:
            a, b = fixed[name]
            seconds += modelled_us(out, ids.shape[1], lambda r, c: a + b * c) / 1e6
        tokens += sum(out.accept_lengths[0])
        rounds += len(out.accept_lengths[0])
        outputs.append(out.sequences[:, ids.shape[1]:])
    row = {"tau": tokens / max(rounds, 1), "modelled_tokens_per_s": tokens / max(seconds, 1e-12), "rounds": rounds,
           "outputs": outputs}
    if options:
        row["options"] = dict(options.most_common())
    return row


def replay(pair, prompts_by_ctx, new_tokens: int, temperatures, costs, fixed) -> list[dict]:
    decoders = {}
    for name, (factory, shape, budget_factory) in pair_methods(pair.draft, TREE, len(TREE)).items():
        budget = budget_factory() if budget_factory is not None else None
        dec = SpeculativeDecoder(pair.target, factory(), tree_shape=shape, budget=budget)
        if budget is not None:
            budget.costs = costs
            for temperature in temperatures:  # greedy and sampled rounds have their own verify costs
                tail = tail_label(SamplingParams(temperature=temperature))
                if not costs.covers(1, budget.options, tail):
                    raise ValueError(f"--costs: the cost model does not cover every adaptive option at batch 1 for "
                                     f"{tail or 'greedy'} rounds (calibrated for other options or sampling: rerun "
                                     f"benchmarks.bench_adaptive on the GPU)")
        decoders[name] = dec
    rows = []
    for ctx, (prompts, packages) in sorted(prompts_by_ctx.items()):
        for temperature in temperatures:
            results = {name: decode(dec, name, prompts, new_tokens, temperature,
                                    decoders[ADAPTIVE].budget.costs, fixed) for name, dec in decoders.items()}
            best = max(results[m]["modelled_tokens_per_s"] for m in FIXED)
            base = results[PLAIN]["outputs"]
            for name, r in results.items():
                same = all(first_difference(a, b) is None for a, b in zip(r.pop("outputs"), base))
                rows.append({"context": ctx, "T": temperature, "method": name, **r,
                             "vs_plain": r["modelled_tokens_per_s"] / results[PLAIN]["modelled_tokens_per_s"],
                             "vs_best_fixed": r["modelled_tokens_per_s"] / best, "identical_to_plain": same,
                             "packages": packages})
                print(f"ctx {ctx:6d} T {temperature} {name:24s} tau {r['tau']:.2f} modelled "
                      f"{r['modelled_tokens_per_s']:7.1f} tok/s vs best fixed x{rows[-1]['vs_best_fixed']:.2f} "
                      f"same={same} {r.get('options', '')}", flush=True)
    return rows


COLUMNS = [("context", "context", ""), ("T", "T", ""), ("method", "method", ""), ("tau", "tau", ".2f"),
           ("rounds", "rounds", ""), ("modelled_tokens_per_s", "modelled tokens/s", ".1f"),
           ("vs_plain", "vs plain", ".2f"), ("vs_best_fixed", "vs best fixed", ".2f"),
           ("identical_to_plain", "same as plain", "")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--costs", default=str(COSTS), help="the adaptive options' CostModel (default: %(default)s)")
    ap.add_argument("--fixed-costs", help="JSON {method: [a, b]} of the fixed methods' round us; default: typed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/cpu/")
    a = ap.parse_args(argv)
    from longspec.pretrained import load_code_pair

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    costs = CostModel.load(a.costs)
    fixed = load_fixed(a.fixed_costs)
    pair = load_code_pair("cpu", torch.float32)
    with torch.inference_mode():
        prompts = pair_prompts(pair.tokenizer, a.contexts, a.prompts)
    rows = replay(pair, prompts, a.new_tokens, a.temperatures, costs, fixed)
    meta = {"device": "cpu (decoding), costs modelled", "dtype": "torch.float32", "prompts_per_context": a.prompts,
            "new_tokens": a.new_tokens, "costs": a.costs,
            "fixed_costs": a.fixed_costs or "typed (H200 step_latency*.md)", "total_s": round(time.perf_counter() - t0)}
    write_results("replay_adaptive", rows, a.out, meta=meta, columns=COLUMNS,
                  title="Adaptive merged drafter replayed on the CPU under a GPU cost model (modelled, not measured)",
                  notes=["tokens/s are MODELLED: generated tokens / the sum of the cost model's round times over the "
                         "rounds each method ran on the CPU; `vs best fixed`: over the best of PLD chain 6, PLD chain "
                         "16, LongSpec tree and LongSpec chain; `python -m benchmarks.replay_adaptive`"])
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
