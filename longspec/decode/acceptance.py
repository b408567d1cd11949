"""The adaptive budget's acceptance statistics: decayed counts of proposed and accepted nodes by (drafter, depth,
draft-score bucket), each option's running realised tau, and the host's exploration counts."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)

SCORE_BUCKET = 0.75  # nats per draft-score bucket: bucket k holds log-probabilities in (-(k+1) * 0.75, -k * 0.75]
NUM_BUCKETS = 16  # the last bucket also takes everything below -11.25, -inf included
PRIOR_WEIGHT = 4.0  # pseudo-count of the prior (the bucket's own probability) in each acceptance estimate
DECAY = 1.0 - 1.0 / 2048  # per round: the counts forget rounds older than a few thousand
REALISED_RATE = 0.2  # weight of the newest round in an option's running realised tau (scored every round)


_STATE = ("proposed", "accepted", "realised", "seen", "mass")


@dataclass
class Exploration:
    """One run's host-side record for the choice: ``scored[k]``, the discounted count of recent rounds whose tree
    surely held option k's (so scored it), and ``rounds``, the discounted count of rounds."""

    scored: list[float]
    rounds: float = 0.0


class AcceptanceStats:
    """Running acceptance counts by (sources, depth, score bucket), and every option's running realised tau.

    Device tensors, updated inside the captured draft and tail steps (no host sync): ``proposed`` / ``accepted``
    float32 ``[S * (D + 1) * NUM_BUCKETS]`` (decayed counts; S = 2 ** parts), ``realised`` float32 ``[options]``
    (running mean of the tau each option realised or would have realised; 1 until ``seen``), ``seen`` bool
    ``[options]``; and on the host the :class:`Exploration` counts the choice keeps.
    """

    def __init__(self, parts: int, max_depth: int, num_options: int, device: torch.device) -> None:
        self.sources, self.max_depth = 2 ** parts, max_depth
        cells = self.sources * (max_depth + 1) * NUM_BUCKETS
        self.proposed = torch.zeros(cells, device=device)
        self.accepted = torch.zeros(cells, device=device)
        bucket = torch.arange(cells, device=device) % NUM_BUCKETS
        self.prior = torch.exp(-(bucket + 0.5) * SCORE_BUCKET)  # the draft's own probability, mid-bucket
        self.prior[bucket == NUM_BUCKETS - 1] = 0.0  # the catch-all bottom bucket: fillers, duplicates
        self.realised = torch.ones(num_options, device=device)
        self.seen = torch.zeros(num_options, dtype=torch.bool, device=device)
        self.mass = torch.zeros(num_options, device=device)  # weight of the rounds behind each running mean
        self.exploration = Exploration([0.0] * num_options)  # host side: AdaptiveBudget.choose counts into it

    def state(self) -> dict:
        """The counts, running means and exploration counts, on the CPU (:meth:`AdaptiveBudget.save_stats`)."""
        state = {name: getattr(self, name).cpu() for name in _STATE}
        state.update(scored=list(self.exploration.scored), rounds=self.exploration.rounds)
        return state

    def load_state(self, state: dict) -> None:
        """Take the values of a :meth:`state` in place (graphs captured over these tensors keep reading them)."""
        for name in _STATE:
            mine, saved = getattr(self, name), state[name]
            if saved.shape != mine.shape or saved.dtype != mine.dtype:
                raise ValueError(f"saved statistics: {name} is {saved.dtype} {list(saved.shape)}, this budget's is "
                                 f"{mine.dtype} {list(mine.shape)}")
            mine.copy_(saved)
        if len(state["scored"]) != len(self.exploration.scored):
            raise ValueError(f"saved statistics: {len(state['scored'])} options scored, this budget has "
                             f"{len(self.exploration.scored)}")
        self.exploration = Exploration([float(n) for n in state["scored"]], float(state["rounds"]))

    def tensors(self) -> list[Tensor]:
        """What the draft and tail steps mutate (restored after their graph warm-up runs)."""
        return [self.proposed, self.accepted, self.realised, self.seen, self.mass]

    def keys(self, depths: Tensor, scores: Tensor, sources: Tensor) -> Tensor:
        """int64 ``[B, T]`` table cells of the nodes (scores and sources as :meth:`AdaptiveBudget.shape` fills
        them)."""
        # clamped before the cast, so truncation is the floor; -inf scores land in the bottom bucket (sources and
        # depths are in range by construction: a part bitmask, a depth of the decoder's tree)
        bucket = (scores / -SCORE_BUCKET).nan_to_num(nan=0.0).clamp(0, NUM_BUCKETS - 1).long()
        return (sources * (self.max_depth + 1) + depths) * NUM_BUCKETS + bucket

    def estimate(self, keys: Tensor) -> Tensor:
        """float32 ``[B, T]``: each node's estimated probability of being accepted."""
        rate = torch.add(self.accepted, self.prior, alpha=PRIOR_WEIGHT) / (self.proposed + PRIOR_WEIGHT)
        return rate[keys]

    def blank(self, rows: int, nodes: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(within, contained)`` of a round that scores no option (a plain round): zeros ``[rows, nodes, K]`` and
        False ``[K]``."""
        K = self.realised.shape[0]
        return torch.zeros(rows, nodes, K, device=device), torch.zeros(K, dtype=torch.bool, device=device)

    def record(self, keys: Tensor, within: Tensor, contained: Tensor, accept_index: Tensor, accept_len: Tensor,
               active: Tensor) -> None:
        """Count a verified round and score the options it contains.

        Args:
            keys: int64 ``[B, T]`` the verified nodes' table cells: every non-root node of the active rows is
                counted as proposed, the accepted path's as accepted.
            within: float32 ``[B, T, K]``: 1 where verified node t is one of option k's kept nodes.
            contained: bool ``[K]``: option k's kept nodes all lie in the verified tree (in every active row); its
                realised tau, 1 + the accepted path's nodes among them, averaged over the active rows, enters its
                running mean.
            accept_index, accept_len: the acceptance (:class:`~longspec.decode.verify.Acceptance`).
            active: bool ``[B]``.

        One op, ``torch.ops.longspec.record_acceptance_`` (:mod:`longspec_ops.reference.stats`; one Triton launch
        on CUDA instead of ~25 small kernels).
        """
        torch.ops.longspec.record_acceptance_(self.proposed, self.accepted, self.realised, self.mass, self.seen, keys,
                                              within, contained, accept_index, accept_len, active, DECAY,
                                              REALISED_RATE)


def sampling_key(params) -> tuple:
    """What acceptance depends on in the sampling settings (the seed does not matter)."""
    return ("greedy",) if params.greedy else (round(params.temperature, 4), params.top_k, round(params.top_p, 4))


__all__ = ["AcceptanceStats", "Exploration", "sampling_key"]
