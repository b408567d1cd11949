"""The adaptive budget's costs measured on this device: every option's round timed on a synthetic run, fitted as
``a + b * context`` (:class:`~longspec.decode.budget.CostModel`), cached on disk per device and decoder."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from .budget import CostModel, fit_line, sampling_key, tail_label
from .sampling import SamplingParams
from .stats import PhaseTimer

if TYPE_CHECKING:
    from .decoder import SpeculativeDecoder


def calibrate(decoder: "SpeculativeDecoder", batch: int, contexts: Sequence[int], reps: int = 3,
              params: Optional[SamplingParams] = None) -> CostModel:
    """See :meth:`SpeculativeDecoder.calibrate`."""
    budget = decoder.budget
    if budget is None:
        raise ValueError("calibrate needs a decoder built with budget=AdaptiveBudget(...)")
    with torch.inference_mode():  # the statistics and the slot's tensors are inference tensors
        return _calibrate(decoder, batch, contexts, reps, params)


def _calibrate(decoder: "SpeculativeDecoder", batch: int, contexts: Sequence[int], reps: int,
               params: Optional[SamplingParams]) -> CostModel:
    budget = decoder.budget
    options = budget.options
    run = decoder.synthetic_run(max(contexts), batch, rounds=2, params=params)
    # The rounds run on the budget's own statistics of these sampling settings, so that the draft graphs they
    # capture are the ones generate replays; every row is inactive (a round then records nothing and moves no
    # state, at the same kernels and shapes), and the statistics are restored afterwards.
    device = run.state.root.device
    run.stats = budget.stats_for(sampling_key(run.params), device)
    saved = [t.clone() for t in run.stats.tensors()]
    run.state.active.zero_()
    verify: dict[int, list] = {}
    draft: dict[str, list] = {}
    with decoder.rounds():
        for context in contexts:
            for i, option in enumerate(options):
                run.state.cache.seqlens.fill_(context)
                decoder.step(run, option=i)  # captures, compiles
                timer = PhaseTimer(device)
                for _ in range(reps):
                    decoder.step(run, timer, option=i)
                us = {k: v * 1e6 / reps for k, v in timer.seconds().items()}
                verify.setdefault(option.nodes, []).append((context, us["verify"] + us["accept"]))
                draft.setdefault(option.draft_key, []).append((context, us["draft"]))
    for t, s in zip(run.stats.tensors(), saved):
        t.copy_(s)
    tail = tail_label(run.params)
    table = {batch: {n: fit_line(p) for n, p in verify.items()}}
    return CostModel({} if tail else table, {batch: {k: fit_line(p) for k, p in draft.items()}},
                     {"device": str(device), "contexts": list(contexts), "reps": reps},
                     {tail: table} if tail else {})


def ensure_costs(decoder: "SpeculativeDecoder", batch: int, extent: int, params: SamplingParams) -> bool:
    """Make sure the budget has costs for this batch and sampling: given, cached on disk, or calibrated now (and
    cached) at ``extent // 4`` and ``extent`` committed rows. Returns whether it calibrated."""
    budget, tail = decoder.budget, tail_label(params)
    if budget.costs is not None and budget.costs.covers(batch, budget.options, tail):
        return False
    path = budget.cost_file(decoder)
    costs = budget.costs or CostModel()
    if path.is_file():
        costs.update(CostModel.load(path))
    measured = not costs.covers(batch, budget.options, tail)
    if measured:
        costs.update(calibrate(decoder, batch, sorted({max(1, extent // 4), extent}), params=params))
        costs.save(path)
    budget.costs = costs
    return measured


__all__ = ["calibrate", "ensure_costs"]
