"""What one generate call holds: :class:`Run` (its state, over a :class:`~longspec.decode.slot.Slot`'s tensors)
and :class:`GenerateOutput` (what it returns)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from .acceptance import AcceptanceStats
from .drafter import DecodeState
from .sampling import NoiseKey, SamplingParams
from .slot import Slot
from .stats import DecodeStats


@dataclass
class GenerateOutput:
    """What :meth:`SpeculativeDecoder.generate` returns.

    sequences:      int64 ``[B, S_in + G]``: the input as given, then each row's generated tokens (G = the longest
                    row's count), right-padded with the pad id (the EOS id when the model has none) after it stopped.
    accept_lengths: list of B lists: ``accept_lengths[b][r]`` = tokens row b emitted by the r-th verify forward it
                    took part in (accepted drafts + bonus, after stop truncation; always 1 for plain decoding). The
                    first token, sampled by the prefill, is not counted, so ``1 + sum(accept_lengths[b])`` is row
                    b's generated length.
    stats:          :class:`DecodeStats`.
    """

    sequences: Tensor
    accept_lengths: list[list[int]]
    stats: DecodeStats


@dataclass
class Run:
    """The mutable state of one generate call: the slot's tensors (static shapes, updated in place) and the host's
    record of the rounds; :meth:`SpeculativeDecoder.step` advances it by one round."""

    slot: Slot
    state: DecodeState  # over the slot's cache, tokens, root and active rows
    params: SamplingParams
    max_new: int
    generator: Optional[torch.Generator]
    history: list[Tensor] = field(default_factory=list)  # per round: int64 [B] tokens emitted
    nodes: list[int] = field(default_factory=list)  # per round: the verified tree's node count
    predicted: list[Tensor] = field(default_factory=list)  # per round under a budget: its option's realised tau []
    options: list[str] = field(default_factory=list)  # per round under a budget: the chosen option's label
    # adaptive budget (SpeculativeDecoder(budget=...)): statistics, and what the last sync read for the choice
    stats: Optional[AcceptanceStats] = None
    context: float = 0.0  # mean committed length of the active rows
    realised: list = field(default_factory=list)  # each option's running realised tau
    seen: list = field(default_factory=list)  # whether it has one
    stale: bool = False  # the drafter sat out a round and has no observe(): prefill it before it drafts again

    @property
    def generated(self) -> Tensor:
        """int64 ``[B]`` tokens emitted so far, root included."""
        return self.slot.generated

    @property
    def pending(self) -> Tensor:
        """int64 ``[B]`` (REFEED) rows ``[seqlens - pending, seqlens)`` held by the last layer only."""
        return self.slot.pending

    @property
    def eos(self) -> Tensor:
        return self.slot.eos

    @property
    def seed(self) -> Optional[NoiseKey]:
        """``params.seed`` as data, when seeded."""
        return self.slot.seed if self.params.seed is not None else None

    @property
    def report(self) -> Optional[Tensor]:
        """float32 ``[2B + 2K]`` under a budget: what the sync reads (:func:`write_report`), written by the tail."""
        return self.slot.report if self.stats is not None else None

    def read(self) -> Callable[[], bool]:
        """Enqueue the round's one device-to-host read; the returned function waits for it and says whether any
        row is still active. Under a budget the same read (of the report the round's tail wrote) brings the
        committed length and every option's running realised tau for the next choice (into ``run``)."""
        run, state, stats = self, self.state, self.stats
        # under a budget: the report the round's tail wrote (write_report), so no op runs eagerly here
        values = state.active.any()[None] if stats is None else run.report
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = values.clone()  # the report is rewritten by the next round's tail

        def wait() -> bool:
            if event is not None:
                event.synchronize()
            got = host.tolist()
            if stats is None:
                return bool(got[0])
            B, K = state.root.shape[0], len(stats.realised)
            active, lens = got[:B], got[B: 2 * B]
            n = sum(active)
            run.context = sum(a * c for a, c in zip(active, lens)) / max(n, 1.0)
            run.realised, run.seen = got[2 * B: 2 * B + K], [v > 0 for v in got[2 * B + K:]]
            return n > 0

        return wait

    @property
    def noise_generator(self) -> Optional[torch.Generator]:
        """The generator the draws consume: only unseeded sampling draws from one (greedy and seeded need none)."""
        return None if self.params.greedy or self.params.seed is not None else self.generator


def write_report(run: Run) -> None:
    """What the next sync reads under a budget, in one float32 tensor: ``[active (B), seqlens (B), realised (K),
    seen (K)]`` (written by the round's tail, inside its graph)."""
    state, stats = run.state, run.stats
    torch.cat([state.active.float(), state.seqlens.float(), stats.realised, stats.seen.float()], out=run.report)


__all__ = ["GenerateOutput", "Run", "write_report"]
