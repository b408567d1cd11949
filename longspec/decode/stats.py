"""What a generate call reports: counters, tau, wall times, and (opt-in) per-phase device times."""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor


@dataclass
class DecodeStats:
    """Per-generate counters. ``tau`` = mean tokens emitted per verify forward over active rows (prefill excluded).

    ``time_prefill`` (from the call's start to the end of the prefill and the drafter's prefill) and
    ``time_decode`` (the rounds) are wall-clock seconds, measured at the syncs the loop makes anyway. With
    ``SpeculativeDecoder(..., phase_times=True)`` the rounds' device time is also split into ``time_draft``,
    ``time_verify`` (the target forward) and ``time_accept`` (the tail), by CUDA events on a GPU (read once at the
    end); otherwise those are None. ``time_capture`` is the part of ``time_decode`` spent capturing CUDA graphs
    (every graph the decoder did not hold yet for this batch size; 0 without graphs, and 0 after a
    :meth:`~longspec.decode.decoder.SpeculativeDecoder.warmup` that covered the call), ``captures`` their number:
    ``time_decode - time_capture`` is the steady decoding time. Reporting, not a benchmark.

    Per round (speculative decoding): ``nodes_per_round`` (the verified tree's size: constant for a fixed tree,
    the budget's choice under an adaptive one, 1 for a plain round), ``realised_tau`` (tokens emitted per active
    row) and, under an adaptive budget, ``predicted_tau`` (the chosen option's running realised tau when it was
    drafted: what the choice was made on) and ``option_per_round`` (the chosen option's label, e.g. ``"plain"`` or
    ``"4-16-16|none/32"``).
    """

    rounds: int = 0
    generated_tokens: int = 0
    tau: float = 0.0
    time_prefill: float = 0.0
    time_decode: float = 0.0
    time_capture: float = 0.0
    captures: int = 0
    time_draft: Optional[float] = None
    time_verify: Optional[float] = None
    time_accept: Optional[float] = None
    nodes_per_round: list[int] = field(default_factory=list)
    realised_tau: list[float] = field(default_factory=list)
    predicted_tau: list[float] = field(default_factory=list)
    option_per_round: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole call (prefill included)."""
        total = self.time_prefill + self.time_decode
        return self.generated_tokens / total if total > 0 else 0.0

    def summary(self) -> str:
        parts = [f"rounds={self.rounds} tokens={self.generated_tokens} tau={self.tau:.2f}",
                 f"tokens/s={self.tokens_per_s:.1f} prefill={self.time_prefill:.3f}s decode={self.time_decode:.3f}s"]
        if self.time_capture:
            parts.append(f"(graph capture {self.time_capture:.3f}s of it)")
        if self.time_draft is not None:
            parts.append(f"draft={self.time_draft:.3f}s verify={self.time_verify:.3f}s "
                         f"accept={self.time_accept:.3f}s")
        if self.predicted_tau:
            parts.append(f"nodes/round={sum(self.nodes_per_round) / len(self.nodes_per_round):.1f} "
                         f"predicted tau={sum(self.predicted_tau) / len(self.predicted_tau):.2f}")
        return " ".join(parts)


class PhaseTimer:
    """Accumulates device time per phase name ("draft", "verify" = the target forward, "accept" = the round's
    tail): CUDA events on a GPU (read once at the end, no per-round sync), wall clock on a CPU. Disabled, it records
    nothing and costs nothing."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.totals[name] += time.perf_counter() - t0

    def seconds(self) -> dict[str, float]:
        if self.cuda and self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self.totals[name] += start.elapsed_time(end) / 1e3
            self._events.clear()
        return dict(self.totals)


def accept_lengths(history: list[Tensor], batch: int) -> list[list[int]]:
    """Per row, the tokens emitted by each round it took part in (from the rounds' int64 ``[B]`` kept counts)."""
    if not history:
        return [[] for _ in range(batch)]
    table = torch.stack(history, dim=1).cpu().tolist()  # [B, rounds]
    return [[n for n in row if n > 0] for row in table]


def collect_stats(history: list[Tensor], generated: Tensor, timer: PhaseTimer, prefill_s: float,
                  decode_s: float, nodes: Sequence[int] = (), predicted: Sequence[Tensor] = (),
                  capture_s: float = 0.0, options: Sequence[str] = (), captures: int = 0) -> DecodeStats:
    emitted = torch.stack(history).cpu() if history else torch.zeros(0, 1, dtype=torch.int64)
    active_pairs = int((emitted > 0).sum())
    per_round = (emitted.sum(dim=1) / (emitted > 0).sum(dim=1).clamp(min=1)).tolist()
    stats = DecodeStats(rounds=len(history), generated_tokens=int(generated.sum()),
                        tau=float(emitted.sum()) / active_pairs if active_pairs else 0.0,
                        time_prefill=prefill_s, time_decode=decode_s, time_capture=capture_s,
                        captures=captures,
                        nodes_per_round=list(nodes),
                        realised_tau=per_round if nodes else [],
                        predicted_tau=torch.stack(list(predicted)).tolist() if predicted else [],
                        option_per_round=list(options))
    if timer.enabled:
        times = timer.seconds()
        stats.time_draft, stats.time_verify, stats.time_accept = (times.get(k, 0.0) for k in ("draft", "verify",
                                                                                             "accept"))
    return stats
