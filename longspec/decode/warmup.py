"""Warm-up: everything a decoder would otherwise do on its first requests, done once up front.

For each batch size: its :class:`~longspec.decode.slot.Slot` is allocated at the largest request's size, so no later
request reallocates the cache (which would invalidate graphs and recompile); then for each sampling setting the
budget's costs are calibrated (when missing) and one synthetic round of every option runs with every row inactive,
which compiles (``compile=True``) and captures (``cuda_graphs=True``) its draft step, target forward and tail on
the slot's tensors. ``generate`` replays them from then on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from tqdm.auto import tqdm

from longspec.model.target import check_generation_length

from . import calibration
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .decoder import SpeculativeDecoder


@dataclass
class WarmupStep:
    """One (batch size, sampling setting) of a warm-up: seconds calibrating the budget (0 when it had costs) and
    running the capture rounds (compiles and captures), and the graphs captured in it."""

    batch: int
    temperature: float
    calibrate_s: float
    rounds_s: float
    captures: int


@dataclass
class WarmupReport:
    """What :meth:`~longspec.decode.decoder.SpeculativeDecoder.warmup` did: its steps, the wall seconds of the
    whole, the bytes of the slots' own tensors (KV caches and round state) and, on CUDA, the further device memory
    reserved during the warm-up (graph pools, compiled code's workspaces, the budget's statistics)."""

    steps: list[WarmupStep] = field(default_factory=list)
    seconds: float = 0.0
    slot_bytes: int = 0
    graph_bytes: Optional[int] = None

    def __str__(self) -> str:
        lines = [f"warmup {self.seconds:.1f}s: KV caches and state {self.slot_bytes / 2**20:.0f} MiB"
                 + (f", graphs and workspaces {self.graph_bytes / 2**20:.0f} MiB" if self.graph_bytes is not None
                    else "")]
        for s in self.steps:
            lines.append(f"  batch {s.batch} T={s.temperature:g}: calibrate {s.calibrate_s:.1f}s, compile and "
                         f"capture {s.rounds_s:.1f}s ({s.captures} graphs)")
        return "\n".join(lines)


def warmup(decoder: "SpeculativeDecoder", batch_sizes: Sequence[int], max_context: Optional[int],
           temperatures: Sequence[float], top_k: int, top_p: float, seeded: bool, progress: bool) -> WarmupReport:
    """See :meth:`~longspec.decode.decoder.SpeculativeDecoder.warmup`."""
    batches = _check_batches(batch_sizes)
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
        raise ValueError(f"max_context must be an int >= 2 (the longest prompt + max_new_tokens to come), got "
                         f"{max_context!r}")
    try:
        check_generation_length(decoder.target, max_context)
    except ValueError as err:
        raise ValueError(f"max_context={max_context}: {err}") from None
    temps = list(temperatures)
    if not temps:
        raise ValueError("temperatures must name at least one temperature (0.0: greedy)")
    settings = [SamplingParams(t, top_k, top_p, 0 if seeded and t >= 1e-5 else None) for t in temps]  # validates
    device = decoder.target.get_output_embeddings().weight.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device) if cuda else 0
    report, t0 = WarmupReport(), time.perf_counter()
    steps = [(b, p) for b in batches for p in settings]
    with torch.inference_mode():  # as generate: the slots' tensors and the budget's statistics are inference tensors
        slots = {b: decoder._slots.get(b, max_context + decoder._scratch_rows(), pin=True) for b in batches}
        _run_steps(decoder, steps, slots, max_context, progress, report, cuda, device)
    report.seconds = time.perf_counter() - t0
    report.slot_bytes = sum(s.nbytes() for s in slots.values())
    if cuda:
        report.graph_bytes = max(0, torch.cuda.memory_reserved(device) - reserved - report.slot_bytes)
    return report


def _run_steps(decoder: "SpeculativeDecoder", steps: list, slots: dict, max_context: int, progress: bool,
               report: WarmupReport, cuda: bool, device: torch.device) -> None:
    bar = tqdm(steps, desc="longspec warmup", disable=not progress, unit="step")
    for batch, params in bar:
        slot = slots[batch]
        before = slot.captures()
        t1 = time.perf_counter()
        if decoder.budget is not None:
            bar.set_postfix_str(f"batch {batch} T={params.temperature:g}: calibrating the budget")
            calibration.ensure_costs(decoder, batch, min(max_context, _synthetic_context(decoder, slot)), params)
        t2 = time.perf_counter()
        bar.set_postfix_str(f"batch {batch} T={params.temperature:g}: compiling and capturing")
        _capture_rounds(decoder, batch, _synthetic_context(decoder, slot), params)
        if cuda:
            torch.cuda.synchronize(device)
        report.steps.append(WarmupStep(batch, params.temperature, t2 - t1, time.perf_counter() - t2,
                                       slot.captures() - before))


def _synthetic_context(decoder: "SpeculativeDecoder", slot) -> int:
    """The longest committed length a synthetic run (calibration or capture: two rounds' room) fits in ``slot``."""
    return slot.cache.max_len - decoder._scratch_rows() - 2 * (decoder.tree.depth + 1) - 1


def _capture_rounds(decoder: "SpeculativeDecoder", batch: int, context: int, params: SamplingParams) -> None:
    """One round of every option (the fixed tree, or each budget option) on a synthetic run in the batch's slot,
    every row inactive: it compiles and captures what a request's rounds replay and changes no statistic."""
    run = decoder.synthetic_run(context, batch, rounds=1, params=params, as_given=True)
    saved = [t.clone() for t in run.stats.tensors()] if run.stats is not None else []
    run.state.active.zero_()
    options = range(len(decoder.budget.options)) if decoder.budget is not None else [None]
    with decoder.rounds():
        for option in options:
            decoder.step(run, option=option)
    if run.stats is not None:
        for t, s in zip(run.stats.tensors(), saved):
            t.copy_(s)


def _check_batches(batch_sizes: Sequence[int]) -> list[int]:
    batches = list(batch_sizes) if not isinstance(batch_sizes, int) else [batch_sizes]
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise ValueError(f"batch_sizes must be a non-empty sequence of ints >= 1, got {batch_sizes!r}")
    return sorted(set(batches))


__all__ = ["WarmupReport", "WarmupStep", "warmup"]
