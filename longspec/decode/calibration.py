"""The adaptive budget's costs measured on this device: every option's round timed on a synthetic run, fitted as
``a + b * context`` (:class:`~longspec.decode.budget.CostModel`), cached on disk per device and decoder."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from longspec.model.target import use_longspec_attention

from .acceptance import sampling_key
from .costs import CostModel, fit_line, tail_label
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
    run = synthetic_run(decoder, max(contexts), batch, rounds=2, params=params)
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


def synthetic_run(decoder: "SpeculativeDecoder", context: int, batch: int = 1, rounds: int = 64, seed: int = 0,
                  params: Optional[SamplingParams] = None, as_given: bool = False):
    """See :meth:`SpeculativeDecoder.synthetic_run`."""
    device = decoder.target.get_output_embeddings().weight.device
    max_new = rounds * (decoder.tree.depth + 1) + 1
    vocab = decoder.target.get_output_embeddings().weight.shape[0]
    params = SamplingParams() if params is None else params
    if not params.greedy and params.seed is None and not as_given:
        params = dataclasses.replace(params, seed=seed)
    with torch.inference_mode(), use_longspec_attention(decoder.target):  # the slot may hold inference tensors
        slot = decoder._slots.get(batch, context + max_new + decoder._scratch_rows())
        gen = torch.Generator(device=device).manual_seed(seed)
        slot.cache.kv.normal_(generator=gen)
        slot.tokens.random_(0, vocab, generator=gen)
        lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        no_stop = torch.zeros(0, dtype=torch.int64, device=device)
        return decoder._begin(slot, lens, slot.tokens[:, context].clone(), params, no_stop, max_new, None)


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


__all__ = ["calibrate", "ensure_costs", "synthetic_run"]
