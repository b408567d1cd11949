"""Adaptive budgets: which tree to verify each round, chosen for tokens per second.

A round's cost grows with the tree (the verify attention over a long context is compute-bound in the node count;
at batch > 1 the linears are too) while its yield, the expected accepted length tau, saturates. So each round the
engine verifies one of a few *options*: a plain step (the root alone, nothing drafted), or a pool the drafter grows
(the decoder's tree, possibly cut to a depth limit, or one part of a merged tree) pruned to its ``nodes`` most
promising nodes (EAGLE-2's rule: rank by cumulative probability, keep the top; here the probability is first
calibrated, below). Every option is a static shape, so each replays from its own CUDA graphs.

* **Cost** (:class:`CostModel`): microseconds of the verify forward plus the tail per node count, and of each draft
  variant, linear in the committed length, per batch size, the verify part apart for greedy and for sampled rounds
  (a draw at T > 0 costs more per node, most at batch > 1). Measured on the device at first use by
  :meth:`~longspec.decode.decoder.SpeculativeDecoder.calibrate` (a few timed steps on a synthetic cache, with the
  call's sampling settings) and cached on disk per device, dtype, model shape, tree, batch and sampling filters; or
  loaded from a file (e.g. one derived from the step benchmark's measurements).
* **Ranking** (:class:`AcceptanceStats`, one per decoder and sampling setting): counts of proposed and accepted nodes
  by (drafter, depth, draft-score bucket), so a node's acceptance probability is estimated from what nodes like it
  did (the draft's own probability is the prior). Inside a pool, a node is ranked by that estimate capped by its
  ancestors' (so a kept node's ancestors are kept): the option keeps its pool's best ``nodes``.
* **Yield**: what each option *realised*, not what the counts predict. After a verified round, every option whose
  kept nodes all lie in the verified tree is scored by the tau it would have realised: the verification walks the
  tree with one target draw per node (the argmax at T = 0; at T > 0 a sample of the node's target distribution that
  does not depend on which other nodes the tree holds), so on a sub-tree the same draws follow the same path until
  it leaves the sub-tree, and the option realises 1 + the accepted path's nodes among its own (a prefix of the path:
  its kept set is ancestor-closed; a duplicate sibling it kept without the first one would count as rejected). A
  running mean of that realised tau per option (``REALISED_RATE``; the weight of the old rounds also decays while
  an option is not scored, so a score coming after a stretch of rounds without one counts for more) is what the
  choice reads; a plain round realises exactly 1. Options the verified tree does not contain keep their estimate
  until a round contains them, and an option is never estimated below one whose kept nodes its tree surely holds.
* **Choice** (:meth:`AdaptiveBudget.choose`, on the host, once per round, from the values the round's one sync
  reads): the option with the highest optimistic realised tau per microsecond at the current committed length and
  batch, plain rounds (tau exactly 1, nothing to learn) included. Optimistic as in discounted UCB (Garivier and
  Moulines, 2011): an option's realised tau plus ``explore * gain * sqrt(log(n)) * (1 / sqrt(n_k) - 1 /
  sqrt(window))``, where n_k counts the recent rounds that scored it (each round's count decays by ``1 - 1 /
  window``, so it reaches ``window`` when every round scores it), n the recent rounds and gain the most any option
  has gained over a plain round (so exploring is cheap where drafts are poor). An option scored every round gets no
  bonus (its mean is as fresh as it gets; discounted UCB's constant floor would keep a drafter that falls just
  short of a plain round verified every round); an option the chosen trees do not contain (prompt lookup while a
  LongSpec tree wins, any drafter while plain rounds win) is verified again once its count has decayed enough, and
  a drafter that stopped paying is dropped after a few rounds. Exploring is priced: the bonus is scaled by
  ``min(1, c* / c_k)``, c_k the option's round cost and c* the cost of the option the means alone would choose
  (trying a 3 ms tree where 0.9 ms plain rounds win costs more than trying a 1.4 ms chain); and optimism is capped
  at the most the option can realise, ``1 + min(depth, nodes - 1)`` (a tree no deeper than a chain that accepts
  nearly every draft cannot beat it, however stale its mean). The first round verifies the largest option, which
  scores every option.

The cost model lives in :mod:`~longspec.decode.costs`, the statistics in :mod:`~longspec.decode.acceptance`, the
calibration in :mod:`~longspec.decode.calibration`; this module holds the options and the choice.

Rows of a batch share the option (one forward) but not the tree: each row keeps its own best nodes. Nothing here
changes what is emitted: every option is a tree verified by the same lossless rule.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from .acceptance import (DECAY, NUM_BUCKETS, PRIOR_WEIGHT, REALISED_RATE, SCORE_BUCKET, AcceptanceStats,  # noqa: F401
                         Exploration, sampling_key)
from .costs import CostModel, cache_path, fit_line, tail_label, time_us  # noqa: F401  (this module's public names)
from .drafter import DraftTree, TreeSpec
from .tree import select_nodes


@dataclass(frozen=True)
class BudgetOption:
    """A tree the engine may verify: ``spec``'s pool pruned to ``nodes`` nodes; ``spec=None`` is a plain round."""

    spec: Optional[TreeSpec]
    nodes: int

    @property
    def draft_key(self) -> str:
        """Names what is drafted (the cost model's key): ``"plain"``, ``"4-16-16"`` or ``"4-16|1-1-1"`` (merged)."""
        return draft_key(self.spec)

    @property
    def label(self) -> str:
        return "plain" if self.spec is None else f"{self.draft_key}/{self.nodes}"


def draft_key(spec: Optional[TreeSpec]) -> str:
    if spec is None:
        return "plain"
    shapes = spec.parts or (spec.shape,)
    return "|".join("-".join(map(str, p)) if p else "none" for p in shapes)


def default_options(spec: TreeSpec, budgets: Sequence[int] = (2, 4, 8, 16, 32, 64),
                    depths: Sequence[int] = (2, 3, 5)) -> list[BudgetOption]:
    """Plain, then for every pool (``spec`` and, when merged, each part alone; each cut at every depth limit in
    ``depths`` and at its full depth) every budget below the pool's size and the whole pool."""
    pools = [spec]
    if spec.parts:
        for i, p in enumerate(spec.parts):
            if p:
                pools.append(TreeSpec(p, tuple(q if j == i else () for j, q in enumerate(spec.parts))))
    options = [BudgetOption(None, 1)]
    for pool in pools:
        for d in sorted({min(d, pool.depth) for d in depths} | {pool.depth}):
            cut = pool.truncate(d)
            for n in sorted({n for n in budgets if 2 <= n < cut.num_nodes} | {cut.num_nodes}):
                options.append(BudgetOption(cut, n))
    return list(dict.fromkeys(options))


# -- the policy -------------------------------------------------------------------------------------------------------


class AdaptiveBudget:
    """Each round, verify the option (:class:`BudgetOption`) with the highest realised tokens per second.

    Args:
        costs: a :class:`CostModel` (or the path of one saved with :meth:`CostModel.save`); None: calibrate on the
            device at the first ``generate`` of each batch size (cached in ``cache_dir``).
        budgets: node counts to prune pools to (each pool's full size is always an option).
        depths: depth limits to grow pools to (the tree's full depth is always one).
        options: an explicit option list instead of ``budgets`` and ``depths`` (each option's spec must be a
            depth-truncated prefix of the decoder's tree or of one of its parts).
        explore: the weight of the optimism bonus ``sqrt(log(n)) * (1 / sqrt(n_k) - 1 / sqrt(window))``, in units
            of the best gain drafting has realised so far (the highest tau - 1, a quarter token at least) (0: none;
            then options the chosen trees do not contain keep their first estimates).
        window: rounds of memory of the counts behind the bonus (each round's count decays by ``1 - 1 / window``).
        cache_dir: where calibrations are kept (default ``$LONGSPEC_CACHE_DIR`` or ``~/.cache/longspec``).
        stats: acceptance statistics saved by :meth:`save_stats` (a path) to start from instead of none, so the
            first ``generate`` chooses as a warmed-up decoder would (for the same options, drafters and prompts of
            the same kind; they keep adapting from there).

    One instance serves one decoder (its statistics are that decoder's); pass it as
    ``SpeculativeDecoder(..., budget=AdaptiveBudget())``.
    """

    def __init__(self, costs: CostModel | str | os.PathLike | None = None,
                 budgets: Sequence[int] = (2, 4, 8, 16, 32, 64), depths: Sequence[int] = (2, 3, 5), options: Optional[Sequence[BudgetOption]] = None,
                 explore: float = 1.0, window: int = 64, cache_dir: Optional[str | os.PathLike] = None,
                 stats: str | os.PathLike | None = None) -> None:
        if costs is not None and not isinstance(costs, CostModel):
            costs = CostModel.load(costs)
        for name, values in (("budgets", budgets), ("depths", depths)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {values!r}")
        if isinstance(explore, bool) or not isinstance(explore, (int, float)) or not 0 <= explore < math.inf:
            raise ValueError(f"explore must be a finite number >= 0, got {explore!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.costs = costs  # (a property: assigning it drops the per-batch cost lines choose() reads)
        self.budgets, self.depths = tuple(budgets), tuple(depths)
        self._given_options = None if options is None else list(options)
        self.explore, self.window = float(explore), window
        self.cache_dir = cache_dir
        self.options: list[BudgetOption] = []
        self.spec: Optional[TreeSpec] = None
        self._stats: dict[tuple, AcceptanceStats] = {}
        self._saved = None if stats is None else _read_stats(stats)

    @property
    def costs(self) -> Optional[CostModel]:
        """The :class:`CostModel` (read once per batch size by :meth:`choose`: assign it again after changing it)."""
        return self._costs

    @costs.setter
    def costs(self, costs: Optional[CostModel]) -> None:
        self._costs = costs
        self._lines: dict[tuple[int, Optional[str]], list[tuple[float, float]]] = {}

    # -- set-up (host) ------------------------------------------------------------------------------------------------

    def bind(self, spec: TreeSpec) -> None:
        """Fix the options for a decoder whose drafter grows ``spec`` (checks explicit options against it)."""
        options = self._given_options or default_options(spec, self.budgets, self.depths)
        for o in options:
            _check_option(o, spec)
        self.spec, self.options = spec, options
        self.largest = max(range(len(options)), key=lambda i: (options[i].nodes, -i))
        # the most tokens a round of each option can emit: its kept nodes' deepest path (at most its depth and its
        # nodes - 1 drafts) and the bonus token
        self._ceiling = [1 + (0 if o.spec is None else min(o.spec.depth, o.nodes - 1)) for o in options]
        self._plain = [o.spec is None for o in options]
        # the options a round of option i surely scores (itself included)
        self._scores = [[j for j, o in enumerate(options) if j == i or _surely_contains(options[i], o)]
                        for i in range(len(options))]
        self._stats.clear()
        if self._saved is not None and self._saved["options"] != [o.label for o in options]:
            raise ValueError(f"AdaptiveBudget(stats=...): the statistics were saved for the options "
                             f"{self._saved['options']}, this decoder's are {[o.label for o in options]}")
        self._lines = {}
        self._pool_groups: dict[tuple, _PoolGroups] = {}  # (draft key, device) -> the options its pool estimates
        self._chain_scoring: dict[tuple, tuple[Tensor, Tensor]] = {}  # (option, rows, device) -> within, contained

    def cost_file(self, decoder) -> Path:
        """Where this decoder's calibration is kept: keyed by the device, dtype, model shape, drafter, tree, options
        and execution settings (the batch sizes are entries inside the file)."""
        target = decoder.target
        config = target.config.get_text_config()
        device = target.get_output_embeddings().weight.device
        drafter = decoder.drafter
        parts = getattr(drafter, "parts", (drafter,))
        key = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "dtype": str(target.dtype),
            "model": {k: getattr(config, k, None) for k in ("model_type", "num_hidden_layers", "hidden_size",
                                                             "intermediate_size", "num_attention_heads",
                                                             "num_key_value_heads", "head_dim", "vocab_size")},
            "drafter": [type(d).__name__ for d in parts],
            "draft_vocab": [getattr(getattr(d, "draft", None), "draft_vocab_size", None) for d in parts],
            "options": [o.label for o in self.options],
            "settings": [decoder.cuda_graphs, decoder._compiled is not None, decoder.kv_update.name],
        }
        return cache_path(self.cache_dir, key)

    def stats_for(self, key: tuple, device: torch.device) -> AcceptanceStats:
        """The statistics of one sampling setting (acceptance differs with the temperature) on one device."""
        full = (*key, str(device))
        if full not in self._stats:
            parts = max(1, len(self.spec.parts))
            self._stats[full] = AcceptanceStats(parts, self.spec.depth, len(self.options), device)
            saved = self._saved["stats"].get(repr(tuple(key))) if self._saved is not None else None
            if saved is not None:
                self._stats[full].load_state(saved)
        return self._stats[full]

    def save_stats(self, path: str | os.PathLike) -> None:
        """Write the acceptance statistics learned so far (every sampling setting; one device's where several were
        used) for ``AdaptiveBudget(stats=path)``."""
        if self.spec is None:
            raise RuntimeError("AdaptiveBudget.save_stats: the budget has no decoder yet (nothing learned)")
        stats = {repr(tuple(key[:-1])): s.state() for key, s in self._stats.items()}
        torch.save({"version": _STATS_VERSION, "options": [o.label for o in self.options], "stats": stats}, path)

    def choose(self, context: float, batch: int, realised: Sequence[float], seen: Sequence[bool],
               exploration: Exploration, tail: Optional[str] = None) -> int:
        """The option index for the next round (host), counted into ``exploration``: the largest option on the
        first round; then the best optimistic realised tau per microsecond (a plain round realises exactly 1, with
        no bonus), at the costs of rounds with this sampling ``tail`` (:func:`tail_label`; None: greedy)."""
        if not any(seen):
            index = self.largest
        else:
            if (batch, tail) not in self._lines:  # each option's round cost a + b * context, looked up once
                c = self.costs
                verify, draft = c.verify_table(batch, tail), c.draft[batch]
                self._lines[(batch, tail)] = [tuple(x + y for x, y in zip(verify[o.nodes], draft[o.draft_key]))
                                              for o in self.options]
            log_n = math.log(max(exploration.rounds, 2.0))
            floor = 1.0 / self.window  # a count never scored gets the bonus of 1 / window rounds
            # a tree that surely holds another's kept nodes realises at least what that one did (at T = 0 the
            # accepted path of the larger tree extends the smaller's), so its estimate is never below theirs
            taus = [max((realised[j] for j in held if seen[j]), default=1.0) for held in self._scores]
            # the bonus in units of what drafting has gained at best so far (a quarter token at least): where every
            # draft is poor (a weak pair at T = 1) exploring is worth little, where one drafter copies whole lines
            # (prompt lookup at T = 0) a stale estimate may hide much
            gain = max(0.25, max((t for t, plain in zip(taus, self._plain) if not plain), default=1.0) - 1.0)
            # the bonus of an option scored every recent round (its count at the window) is 0: its running mean is
            # as fresh as it gets, so only staleness earns optimism (a constant bonus would keep a drafter that
            # falls just short of a plain round verified every round)
            bonus = self.explore * gain * math.sqrt(log_n)
            fresh = 1.0 / math.sqrt(self.window)
            costs = [max(a + b * context, 1e-9) for a, b in self._lines[(batch, tail)]]
            # exploring is priced: an option's bonus shrinks by its cost over the cost of the option the means alone
            # would choose (a 3 ms tree explored where 0.9 ms plain rounds win costs 2 rounds' worth), and optimism
            # never exceeds what the option can realise, its deepest path plus the bonus token (a chain that copied
            # whole lines is not given up for a larger tree that cannot realise more)
            best = costs[max(range(len(costs)), key=lambda k: taus[k] / costs[k])]
            rates = [1.0 / c if plain else
                     min(tau + bonus * max(0.0, 1.0 / math.sqrt(max(n, floor)) - fresh) * min(1.0, best / c), top) / c
                     for c, tau, plain, n, top in zip(costs, taus, self._plain, exploration.scored, self._ceiling)]
            index = max(range(len(rates)), key=rates.__getitem__)  # the first of equals
        keep = 1.0 - 1.0 / self.window
        exploration.rounds = exploration.rounds * keep + 1.0
        exploration.scored = [n * keep for n in exploration.scored]
        for j in self._scores[index]:
            exploration.scored[j] += 1.0
        return index

    # -- device steps (captured) --------------------------------------------------------------------------------------

    def shape(self, stats: AcceptanceStats, pool: DraftTree, index: int,
              active: Tensor) -> tuple[DraftTree, Tensor, tuple[Tensor, Tensor, Tensor]]:
        """Prune a complete pool tree (grown for option ``index``) to the option's budget, and say which nodes of
        the pruned tree every option this pool contains would have kept. Returns ``(tree, predicted tau [],
        (keys [B, T], within [B, T, K], contained [K]))``: the option's running realised tau (what the choice was
        made on), the kept nodes' statistics cells and the option scoring that :meth:`AcceptanceStats.record`
        takes after the verify.

        Every option the pool contains (its nodes: the pool cut to the option's depth limit and parts) ranks them
        by estimate in one batched stable sort over ``[groups, B, P]``; option m keeps the first ``nodes`` of its
        group's ranking. No Python scalar enters a device tensor: the step runs inside a CUDA-graph capture."""
        option = self.options[index]
        depths = pool.depths
        B, P = depths.shape
        # a single drafter's nodes are all part 0's (bit 0); a drafter without scores vouches for every node
        scores = torch.zeros(depths.shape, device=depths.device) if pool.scores is None else pool.scores
        sources = torch.ones_like(depths) if pool.sources is None else pool.sources
        pool = dataclasses.replace(pool, scores=scores, sources=sources)
        keys = stats.keys(depths, scores, sources)
        if all(n == 1 for n in option.spec.shape):
            return self._shape_chain(stats, pool, keys, index)
        groups = self._groups(option, pool.depths.device)
        p = stats.estimate(keys)
        p[:, 0] = 1.0  # the root: the bonus token, always emitted
        # capped by every ancestor's: a node never ranks above its parent, so a kept set is ancestor-closed (the
        # stable sort breaks ties by index, and parents come first)
        p = torch.where(pool.mask, p[:, None, :], 1.0).amin(dim=-1)
        member = depths <= groups.depth  # [G, B, P]
        if groups.bits is not None:
            member &= ((sources & groups.bits) != 0) | (depths == 0)
        order = torch.sort(torch.where(member, p, -1.0), dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(P, device=order.device).expand_as(order))
        if option.nodes == P:  # the whole pool: nothing to prune
            kept, tree = torch.arange(P, device=order.device).expand(B, P), pool
        else:
            kept = order[groups.own[index]][:, : option.nodes].sort(dim=-1).values
            tree = select_nodes(pool, kept)
        # option m keeps its group's members ranked below its budget: which verified nodes those are, and whether
        # the verified tree holds all of them
        at = kept.expand(order.shape[0], -1, -1)  # [G, B, T]
        mine = member.gather(-1, at)[groups.group] & (rank.gather(-1, at)[groups.group] < groups.budget)  # [M, B, T]
        size = torch.minimum(member.sum(dim=-1)[groups.group], groups.budget[:, :, 0])  # [M, B]
        whole = ((mine.sum(dim=-1) == size) | ~active).all(dim=-1)  # [M]
        within, contained = stats.blank(B, kept.shape[1], depths.device)
        within.index_copy_(2, groups.members, mine.permute(1, 2, 0).float())
        contained.index_copy_(0, groups.members, whole)
        return tree, stats.realised[index].clone(), (keys.gather(1, kept), within, contained)

    def _shape_chain(self, stats: AcceptanceStats, pool: DraftTree, keys: Tensor,
                     index: int) -> tuple[DraftTree, Tensor, tuple[Tensor, Tensor, Tensor]]:
        """:meth:`shape` for a chain pool (one node per depth; prompt lookup's), in a handful of operators instead
        of the ranking's ~50 (a round of the pair is launch-bound). Node t's estimate is capped by its ancestors',
        all of nodes 0 .. t - 1, so the ranking is the chain's own order whatever the statistics: the option keeps
        nodes 0 .. nodes - 1, and an option it contains (a chain cut to depth d, pruned to n nodes) keeps nodes 0 ..
        min(d + 1, n) - 1, in every row. ``within`` and ``contained`` are constants of (option, rows), made on the
        first call (a graph capture's warm-up run)."""
        option = self.options[index]
        B, P = pool.depths.shape
        device = pool.depths.device
        key = (index, B, device)
        if key not in self._chain_scoring:
            within = torch.zeros(B, option.nodes, len(self.options))
            contained = torch.zeros(len(self.options), dtype=torch.bool)
            for j, o, _ in self._pooled(option):
                size = min(o.spec.depth + 1, o.nodes, P)  # option j's kept nodes: the first `size` of the chain
                within[:, : min(size, option.nodes), j] = 1.0
                contained[j] = size <= option.nodes
            self._chain_scoring[key] = (within.to(device), contained.to(device))
        within, contained = self._chain_scoring[key]
        if option.nodes == P:
            tree = pool
        else:
            tree = select_nodes(pool, torch.arange(option.nodes, device=device).expand(B, -1))
        return tree, stats.realised[index].clone(), (keys[:, : option.nodes], within, contained)

    def _groups(self, drafted: BudgetOption, device: torch.device) -> "_PoolGroups":
        """The options whose pools lie inside ``drafted``'s, as index tensors on ``device`` (made on the first
        call, which is a graph capture's warm-up run, outside the capture)."""
        key = (drafted.draft_key, device)
        if key not in self._pool_groups:
            groups: dict[tuple, list] = {}
            for j, o, bits in self._pooled(drafted):
                groups.setdefault((o.spec.depth, bits), []).append((j, o.nodes))
            self._pool_groups[key] = _PoolGroups.build(list(groups.items()), device)
        return self._pool_groups[key]

    def _pooled(self, drafted: BudgetOption) -> list[tuple[int, BudgetOption, Optional[int]]]:
        """``(index, option, part bits)`` of the options whose pools lie inside ``drafted``'s (bits None for a
        single drafter's tree)."""
        out = []
        for j, o in enumerate(self.options):
            if o.spec is None or o.spec.depth > drafted.spec.depth:
                continue
            bits = None
            if drafted.spec.parts:
                bits, theirs = _part_bits(o.spec), _part_bits(drafted.spec)
                if bits & ~theirs or any(len(p) > len(q) for p, q in zip(o.spec.parts, drafted.spec.parts)):
                    continue
            out.append((j, o, bits))
        return out


@dataclass
class _PoolGroups:
    """The options a pool scores, grouped by the pool cut they rank (depth limit, parts), as device tensors.

    depth:   int64 ``[G, 1, 1]`` each group's depth limit.
    bits:    int64 ``[G, 1, 1]`` each group's part bitmask (None: a single drafter's tree).
    members: int64 ``[M]`` the option indices, group by group.
    group:   int64 ``[M]`` each member's group.
    budget:  int64 ``[M, 1, 1]`` each member's node budget.
    own:     option index -> its group (a Python int).
    """

    depth: Tensor
    bits: Optional[Tensor]
    members: Tensor
    group: Tensor
    budget: Tensor
    own: dict[int, int]

    @classmethod
    def build(cls, groups: list[tuple[tuple[int, Optional[int]], list[tuple[int, int]]]],
              device: torch.device) -> "_PoolGroups":
        members = [(g, j, n) for g, (_, m) in enumerate(groups) for j, n in m]

        def tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        bits = [b for (_, b), _ in groups]
        return cls(tensor([d for (d, _), _ in groups])[:, None, None],
                   None if bits[0] is None else tensor(bits)[:, None, None],
                   tensor([j for _, j, _ in members]), tensor([g for g, _, _ in members]),
                   tensor([n for _, _, n in members])[:, None, None], {j: g for g, j, _ in members})


_STATS_VERSION = 1


def _read_stats(path: str | os.PathLike) -> dict:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("version") != _STATS_VERSION:
        raise ValueError(f"AdaptiveBudget(stats={str(path)!r}): not statistics written by AdaptiveBudget.save_stats "
                         f"(version {_STATS_VERSION})")
    return saved


def _part_bits(spec: TreeSpec) -> int:
    return sum(1 << i for i, p in enumerate(spec.parts) if p)


def _surely_contains(big: BudgetOption, small: BudgetOption) -> bool:
    """Whether ``big``'s tree holds ``small``'s kept nodes whatever the estimates: every tree holds a plain round's
    root; a larger budget of the same pool cut holds a smaller one's; a whole pool holds every option of a pool
    cut inside it."""
    if big.spec is None:
        return False
    if small.spec is None:
        return True
    if big.spec == small.spec:
        return big.nodes >= small.nodes
    inside = small.spec.depth <= big.spec.depth and (not big.spec.parts or (
        _part_bits(small.spec) & ~_part_bits(big.spec) == 0
        and all(len(p) <= len(q) for p, q in zip(small.spec.parts, big.spec.parts))))
    return inside and big.nodes == big.spec.num_nodes


def _check_option(option: BudgetOption, spec: TreeSpec) -> None:
    """An option's pool must be something the drafter can grow: the decoder's tree (or, merged, a subset of its
    parts), each cut to a common depth limit; and its budget must fit the pool."""
    if not isinstance(option, BudgetOption):
        raise ValueError(f"options must be BudgetOption instances, got {option!r}")
    if option.spec is None:
        if option.nodes != 1:
            raise ValueError(f"a plain option verifies the root alone (nodes=1), got nodes={option.nodes}")
        return
    o = option.spec
    ok = o.depth <= spec.depth and bool(o.parts) == bool(spec.parts)
    if ok and not spec.parts:
        ok = o.shape == spec.shape[: o.depth]
    elif ok:
        ok = len(o.parts) == len(spec.parts) and all(
            not p or p == q[: len(p)] and (len(p) == min(o.depth, len(q))) for p, q in zip(o.parts, spec.parts))
    if not ok:
        raise ValueError(f"option {option.label}: its tree must be a depth-truncated prefix of the decoder's tree "
                         f"{draft_key(spec)} (or of some of its parts)")
    if not 1 <= option.nodes <= o.num_nodes:
        raise ValueError(f"option {option.label}: nodes must be in [1, {o.num_nodes}] (the pool's size)")


def root_tree(root: Tensor) -> DraftTree:
    """The tree of a plain round: each row's root alone."""
    B = root.shape[0]
    zeros = torch.zeros(B, 1, dtype=torch.int64, device=root.device)
    return DraftTree(root[:, None].clone(), zeros - 1, torch.ones(B, 1, 1, dtype=torch.bool, device=root.device),
                     zeros, torch.zeros(B, 1, device=root.device), zeros)


__all__ = ["AcceptanceStats", "AdaptiveBudget", "BudgetOption", "CostModel", "default_options", "fit_line",
           "tail_label"]
