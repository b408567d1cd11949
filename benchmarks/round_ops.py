"""Operator counts of one speculative round, by piece: what the adaptive budget and the merged drafter add.

A round of the shipped pair on an H200 is launch-bound: every kernel inside a captured graph costs a few
microseconds, and every eager op between the round's sync and the next replay leaves the GPU idle. This counts the
ATen operators (``longspec::`` custom ops included, views and allocations left out: they launch nothing) each piece
of a round dispatches, on the CPU, with a :class:`~torch.utils._python_dispatch.TorchDispatchMode`. A CPU op is
not a CUDA kernel (a sort or a scatter may launch several on the GPU), so the counts compare code paths; they are
not a launch census.

Pieces: ``sync`` (the round's host read), ``draft`` (inside the captured draft graph: each part's ``propose`` or
``observe``, ``merge``, ``shape``, the rest), ``verify`` (the target forward), ``tail`` (inside the captured tail
graph: acceptance and commit, ``stats``: the budget's counts) and ``host`` (eager ops between the graphs).

Usage (CPU): ``python -m benchmarks.round_ops``; ``--context`` sets the committed length of the synthetic run.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_adaptive import TREE, merged_budget, merged_drafter, merged_spec
from longspec import LongSpecDrafter, PromptLookupDrafter, SpeculativeDecoder
from longspec.decode import budget as budget_mod, decoder as decoder_mod, merge as merge_mod
from longspec.decode.budget import CostModel

CHAIN = 5  # the fixed PLD chain of 6, as bench_adaptive's
NOT_KERNELS = {"empty", "empty_strided", "empty_like", "new_empty", "lift_fresh", "_local_scalar_dense", "resolve_conj",
               "resolve_neg"}


class OpCounter(TorchDispatchMode):
    """Counts every operator that computes something (not a view, not an allocation; a possibly-aliasing op such as
    ``aten.to`` when it made a copy) under the innermost label of ``self.stack``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = ["host"]
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in NOT_KERNELS and (not func.is_view or _copied(args, out)):
            self.counts[self.stack[-1]] += 1
        return out


def _copied(args, out) -> bool:
    """Whether an op whose schema may alias its input (``to``, ``contiguous``, ...) returned new memory."""
    if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
        return False
    return out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()


@contextlib.contextmanager
def labelled(counter: OpCounter, targets: dict[str, tuple[object, str]]):
    """Within the block, calls of ``owner.attr`` count under ``label`` (``targets``: label -> (owner, attr))."""
    saved = []
    for label, (owner, attr) in targets.items():
        fn = getattr(owner, attr)
        saved.append((owner, attr, owner.__dict__[attr] if attr in owner.__dict__ else None))

        def wrapped(*args, _fn=fn, _label=label, **kwargs):
            counter.stack.append(_label)
            try:
                return _fn(*args, **kwargs)
            finally:
                counter.stack.pop()

        setattr(owner, attr, functools.wraps(fn)(wrapped))
    try:
        yield
    finally:
        for owner, attr, old in saved:
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


def pieces(counter: OpCounter) -> dict[str, tuple[object, str]]:
    return {
        "sync": (decoder_mod.SpeculativeDecoder, "_read"),
        "draft": (decoder_mod.SpeculativeDecoder, "_draft_body"),
        "draft/longspec propose": (LongSpecDrafter, "propose"),
        "draft/longspec observe": (LongSpecDrafter, "observe"),
        "draft/pld propose": (PromptLookupDrafter, "propose"),
        "draft/merge": (merge_mod, "merge_trees"),
        "draft/shape": (budget_mod.AdaptiveBudget, "shape"),
        "verify": (decoder_mod.SpeculativeDecoder, "_verify_logits"),
        "tail": (decoder_mod.SpeculativeDecoder, "_tail_body"),
        "tail/stats": (budget_mod.AcceptanceStats, "record"),
    }


def count_round(dec: SpeculativeDecoder, context: int, option, rounds: int = 3) -> Counter:
    """Ops per round (the mean over ``rounds`` after one warm-up round) of ``dec`` forced to ``option``, sync
    included."""
    run = dec.synthetic_run(context, rounds=rounds + 2)
    counter = OpCounter()
    with dec.rounds():
        dec.step(run, option=option)
        run.read()()
        with labelled(counter, pieces(counter)), counter:
            for _ in range(rounds):
                run.read()()
                dec.step(run, option=option)
    return Counter({k: v / rounds for k, v in counter.counts.items()})


def decoders(pair) -> dict[str, tuple[SpeculativeDecoder, list]]:
    """name -> (decoder, [(option label, option index or None)])."""
    pld = SpeculativeDecoder(pair.target, PromptLookupDrafter(), tree_shape=(1,) * (CHAIN + 1))
    budget = merged_budget()
    merged = SpeculativeDecoder(pair.target, merged_drafter(pair.draft), tree_shape=merged_spec(TREE), budget=budget)
    budget.costs = CostModel({1: {o.nodes: (1.0, 0.0) for o in budget.options}},
                             {1: {o.draft_key: (0.0, 0.0) for o in budget.options}})
    pld16 = "-".join(["1"] * 16)
    wanted = [f"none|{pld16}/17", "none|1-1-1-1-1-1/7", "none|1-1-1/4", "4-16-16-16-16|none/48",
              f"4-16-16-16-16|{pld16}/48", "plain"]
    labels = [o.label for o in budget.options]
    return {"PLD chain 6": (pld, [("fixed", None)]),
            "adaptive LongSpec+PLD": (merged, [(w, labels.index(w)) for w in wanted if w in labels])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args(argv)
    from longspec.pretrained import load_code_pair

    torch.manual_seed(0)
    pair = load_code_pair("cpu")
    for name, (dec, options) in decoders(pair).items():
        for label, option in options:
            c = count_round(dec, a.context, option)
            top = {k: v for k, v in c.items() if "/" not in k}
            sub = {k: v for k, v in c.items() if "/" in k}
            total = sum(c.values())
            print(f"{name:22s} {label:30s} total {total:6.1f}  " + "  ".join(f"{k} {v:.0f}" for k, v in sorted(top.items()))
                  + "  | " + "  ".join(f"{k} {v:.0f}" for k, v in sorted(sub.items())), flush=True)


if __name__ == "__main__":
    main()
