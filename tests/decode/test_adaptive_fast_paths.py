"""The adaptive round's fast paths against the general code they replace: the single-part merge, the path
de-duplication, the shape scoring and the counterfactual tau, each checked against a plain (naive) version of
itself (the exactness of whole rounds is in ``test_adaptive``)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from longspec import AdaptiveBudget, TreeSpec
from longspec.decode.drafter import DraftTree
from longspec.decode.merge import merge_trees
from longspec.decode.tree import complete_tree, select_nodes
from longspec.decode.verify import accept_tree

from .test_adaptive import toy_pool
from .test_tree import naive_mask, random_parents


def distinct_pool(spec: TreeSpec, rows: int, seed: int) -> DraftTree:
    """Random level-order trees whose siblings are distinct (every node its own token), scores falling with depth."""
    g = torch.Generator().manual_seed(seed)
    T = spec.num_nodes
    tokens = torch.randperm(1000, generator=g)[: rows * T].reshape(rows, T)
    scores = -torch.rand(rows, T, generator=g).cumsum(dim=1)
    scores[:, 0] = 0.0
    return complete_tree(DraftTree(tokens, random_parents(spec, rows, seed), scores=scores), spec)


@pytest.mark.parametrize("part_shapes", [((), (1, 1, 1, 1)), ((3, 4, 4), ())])
def test_single_part_merge_is_the_general_merge(part_shapes):
    """With one part drafted, merge_trees returns that part's tree as it is: every field equal to what the general
    layout-and-deduplicate path returns (siblings distinct, as the built-in drafters propose them)."""
    from longspec.decode.merge import _merge_all

    spec = TreeSpec.merged(*part_shapes)
    part = next(i for i, p in enumerate(part_shapes) if p)
    tree = distinct_pool(spec.part_specs()[part], 3, seed=7)
    trees = [tree if i == part else None for i in range(2)]
    root = tree.tokens[:, 0]
    fast, general = merge_trees(root, trees, spec), _merge_all(root, trees, spec, None)
    for name in ("tokens", "parents", "mask", "depths", "scores", "sources"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name


def level_merge(root: torch.Tensor, trees, spec: TreeSpec) -> DraftTree:
    """merge_trees's general path as it was first written (deduplicated level by level through canonical parents),
    the reference for the path-based version."""
    B, T = root.shape[0], spec.num_nodes
    tokens = root[:, None].expand(B, T).clone()
    parents = torch.zeros(B, T, dtype=torch.int64)
    scores = torch.full((B, T), float("-inf"))
    sources = torch.zeros(B, T, dtype=torch.int64)
    parents[:, 0], scores[:, 0] = -1, 0.0
    for i, (tree, nodes) in enumerate(zip(trees, spec.part_nodes())):
        idx = torch.tensor(nodes)
        tokens[:, idx[1:]] = tree.tokens[:, 1:]
        parents[:, idx[1:]] = idx[tree.parents[:, 1:]]
        scores[:, idx[1:]] = tree.scores[:, 1:]
        sources[:, idx[1:]] = 1 << i
    canon = torch.arange(T).expand(B, T).clone()
    for d in range(1, spec.depth + 1):
        lo, hi = spec.offsets[d], spec.offsets[d + 1]
        n = hi - lo
        par, tok = canon.gather(1, parents[:, lo:hi]), tokens[:, lo:hi]
        same = (par[:, :, None] == par[:, None, :]) & (tok[:, :, None] == tok[:, None, :])
        same &= torch.ones(n, n).tril().bool()
        first = same.to(torch.int8).argmax(dim=-1)
        canon[:, lo:hi], parents[:, lo:hi] = lo + first, par
        twin = first[:, :, None] == torch.arange(n)
        merged = torch.zeros(B, n, dtype=torch.int64)
        for i in range(len(trees)):
            merged |= (twin & ((sources[:, lo:hi, None] >> i) & 1 == 1)).any(dim=1).long() << i
        sources[:, lo:hi] = merged
        scores[:, lo:hi] = torch.where(first != torch.arange(n), float("-inf"), scores[:, lo:hi])
    return DraftTree(tokens, parents, naive_mask(parents), spec.depth_tensor("cpu").expand(B, T), scores, sources)


@pytest.mark.parametrize("part_shapes", [((2, 3), (1, 1, 1)), ((4, 16, 16), (1, 1)),
                                         ((3, 5, 4), (2, 2, 2), (1, 1, 1, 1))])
def test_path_dedup_is_the_level_by_level_dedup(part_shapes):
    """merge_trees deduplicates all levels at once by token path; on random parts over a small vocabulary
    (duplicates everywhere) every field equals the level-by-level reference's."""
    spec = TreeSpec.merged(*part_shapes)
    for seed, vocab in itertools.product(range(4), (2, 5)):
        parts = [toy_pool(s, vocab, 3, seed=10 * seed + i) for i, s in enumerate(spec.part_specs())]
        root = parts[0].tokens[:, 0]
        for p in parts[1:]:
            p.tokens[:, 0] = root
        got, want = merge_trees(root, parts, spec), level_merge(root, parts, spec)
        for name in ("tokens", "parents", "mask", "depths", "scores", "sources"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (seed, vocab, name)
        assert (got.scores == float("-inf")).any(), "no duplicate exercised"


def naive_scoring(budget: AdaptiveBudget, stats, pool: DraftTree, index: int, active: torch.Tensor):
    """AdaptiveBudget.shape's pruning and option scoring, one option and one row at a time in Python: every option
    the pool contains keeps the first ``nodes`` of its members (its depth limit and parts) ranked by the capped
    estimate, ties to the lower index. Returns (kept pool indices per row, within [B, T, K], contained [K])."""
    from longspec.decode.budget import _part_bits

    option = budget.options[index]
    p = stats.estimate(stats.keys(pool.depths, pool.scores, pool.sources))
    p[:, 0] = 1.0
    p = torch.where(pool.mask, p[:, None, :], torch.ones_like(p)[:, None, :]).amin(dim=-1)
    B, P = p.shape

    def kept_by(o, b):
        members = [i for i in range(P) if pool.depths[b, i] <= o.spec.depth and (
            i == 0 or not o.spec.parts or int(pool.sources[b, i]) & _part_bits(o.spec))]
        ranked = sorted(range(P), key=lambda i: (i not in members, -float(p[b, i]) if i in members else 0, i))
        return {i for i in ranked[: o.nodes] if i in members}, sorted(ranked[: o.nodes])

    kept = [sorted(range(P)) if option.nodes == P else kept_by(option, b)[1] for b in range(B)]
    within = torch.zeros(B, len(kept[0]), len(budget.options))
    contained = torch.zeros(len(budget.options), dtype=torch.bool)
    for k, o in enumerate(budget.options):
        if o.spec is None or o.spec.depth > option.spec.depth or (
                option.spec.parts and (_part_bits(o.spec) & ~_part_bits(option.spec) or any(
                    len(a) > len(c) for a, c in zip(o.spec.parts, option.spec.parts)))):
            continue
        holds = []
        for b in range(B):
            mine = kept_by(o, b)[0]
            within[b, :, k] = torch.tensor([float(i in mine) for i in kept[b]])
            holds.append(mine <= set(kept[b]) or not active[b])
        contained[k] = all(holds)
    return torch.tensor(kept), within, contained


@pytest.mark.parametrize("label", ["3-4-4|1-1-1-1/8", "3-4-4|1-1-1-1/16", "3-4|1-1/4", "none|1-1-1-1/5", "3-4-4|none/8",
                                   "none|1-1-1-1/4", "none|1-1-1-1/2", "none|1-1/3", "chain 1-1-1-1/5",
                                   "chain 1-1-1-1/2", "chain 1-1/3"])
def test_shape_scores_the_options_its_tree_contains(label):
    """The batched AdaptiveBudget.shape keeps, per row, the nodes the one-at-a-time reference keeps, and marks the
    same nodes of every option and the same contained options; its keys are the kept nodes' statistics cells and
    its predicted tau the option's running realised tau. Chain pools (prompt lookup's, in a merged tree or alone:
    ``chain``) take the constant-scoring path."""
    from longspec.decode.budget import AcceptanceStats

    single = label.startswith("chain ")
    spec = TreeSpec((1, 1, 1, 1)) if single else TreeSpec.merged((3, 4, 4), (1, 1, 1, 1))
    label = label.removeprefix("chain ")
    budget = AdaptiveBudget(budgets=(2, 4, 8), depths=(2,))
    budget.bind(spec)
    index = [o.label for o in budget.options].index(label)
    drafted = budget.options[index].spec
    g = torch.Generator().manual_seed(3)
    stats = AcceptanceStats(1 if single else 2, spec.depth, len(budget.options), torch.device("cpu"))
    counts = torch.rand(2, stats.proposed.numel(), generator=g) * 10
    stats.proposed.copy_(counts[0] + counts[1])
    stats.accepted.copy_(counts[1])
    stats.realised.copy_(torch.rand(len(budget.options), generator=g) + 1)
    active = torch.tensor([True, False, True])
    for seed in range(3):
        if single:
            pool = distinct_pool(drafted, 3, seed=10 * seed)
            pool = dataclasses.replace(pool, sources=torch.ones_like(pool.depths))
        else:
            parts = [distinct_pool(s, 3, seed=10 * seed + i) if s is not None else None
                     for i, s in enumerate(drafted.part_specs())]
            pool = merge_trees(torch.zeros(3, dtype=torch.int64), parts, drafted)
        tree, predicted, (keys, within, contained) = budget.shape(stats, pool, index, active)
        kept, want_within, want_contained = naive_scoring(budget, stats, pool, index, active)
        want = select_nodes(pool, kept)
        for name in ("tokens", "parents", "mask", "depths", "scores", "sources"):
            assert torch.equal(getattr(tree, name), getattr(want, name)), name
        assert torch.equal(within, want_within) and torch.equal(contained, want_contained)
        assert contained[index], "the verified option contains itself"
        assert torch.equal(keys, stats.keys(tree.depths, tree.scores, tree.sources))
        assert predicted == stats.realised[index]


def hand_tree() -> tuple[AdaptiveBudget, DraftTree]:
    """Two rows of one pool of TreeSpec((2, 2)): root 0; 1 and 2 under it; 3 and 4 under 1. Scores put the nodes in
    the draft-score buckets 0 (nodes 1 and 3), 2 (node 2) and 4 (node 4), so with fresh statistics the depth-2
    ranking is 0, 1, 3, 2, 4 and the depth-1 ranking 0, 1, 2."""
    spec = TreeSpec((2, 2))
    budget = AdaptiveBudget(budgets=(2, 3), depths=(1,))
    budget.bind(spec)
    tokens = torch.tensor([[9, 11, 12, 13, 14]] * 2)
    scores = torch.tensor([[0.0, -0.1, -2.0, -0.5, -3.0]] * 2)
    pool = complete_tree(DraftTree(tokens, torch.tensor([[-1, 0, 0, 1, 1]] * 2), scores=scores), spec)
    return budget, pool


def verify_round(budget, stats, pool, label: str, draws: list[list[int]], active=(True, True)) -> list[int]:
    """Shape the pool to ``label``, accept along the given per-node draws ([B, P] over the *pool's* nodes), record;
    returns the rows' accepted lengths."""
    index = [o.label for o in budget.options].index(label)
    active = torch.tensor(active)
    tree, _, (keys, within, contained) = budget.shape(stats, pool, index, active)
    kept = [[int(i) for i in torch.nonzero((tree.tokens[b, :, None] == pool.tokens[b]).any(0))[:, 0]]
            for b in range(2)]
    y = torch.tensor([[draws[b][i] for i in kept[b]] for b in range(2)])
    acc = accept_tree(tree.tokens, tree.parents, tree.mask, y, tree.depths, max_depth=2)
    stats.record(keys, within, contained, acc.accept_index, acc.accept_len, active)
    return acc.accept_len.tolist()


def test_counterfactual_tau_on_a_hand_built_tree():
    """Each option the verified tree contains is scored by 1 + the accepted path's nodes among its own kept nodes;
    the others keep their estimate; once an option has been seen the running mean moves towards a new score by
    R / ((1 - R) * m + R), m the weight behind the mean (R = REALISED_RATE; every verified round multiplies m by
    1 - R, a score adds R to it)."""
    from longspec.decode.budget import REALISED_RATE, AcceptanceStats

    R = REALISED_RATE

    def weight(m):  # the new score's weight when the mean had weight m before this round
        return R / ((1 - R) * m + R)

    budget, pool = hand_tree()
    labels = [o.label for o in budget.options]
    assert labels == ["plain", "2/2", "2/3", "2-2/2", "2-2/3", "2-2/5"]
    stats = AcceptanceStats(1, 2, len(labels), torch.device("cpu"))
    # row 0: the target continues 11 13 (nodes 1, 3); row 1: 12 (node 2), which "2-2/3" does not hold
    draws = [[11, 13, 0, 0, 0], [12, 0, 0, 0, 0]]
    assert verify_round(budget, stats, pool, "2-2/3", draws) == [3, 1]
    # contained: 2/2 = {0, 1}, 2-2/2 = {0, 1}, 2-2/3 itself; not 2/3 (node 2) nor 2-2/5
    assert stats.seen.tolist() == [False, True, False, True, True, False]
    assert stats.realised.tolist() == [1.0, (2 + 1) / 2, 1.0, (2 + 1) / 2, (3 + 1) / 2, 1.0]
    # the whole pool contains every option: row 0 realises 3 (its path 1, 3), row 1 2 (node 2)
    assert verify_round(budget, stats, pool, "2-2/5", draws) == [3, 2]
    new = {"2/2": (2 + 1) / 2, "2/3": (2 + 2) / 2, "2-2/2": (2 + 1) / 2, "2-2/3": (3 + 1) / 2, "2-2/5": (3 + 2) / 2}
    old = {"2/2": 1.5, "2/3": None, "2-2/2": 1.5, "2-2/3": 2.0, "2-2/5": None}
    want = [1.0] + [new[k] if old[k] is None else old[k] + weight(R) * (new[k] - old[k]) for k in labels[1:]]
    torch.testing.assert_close(stats.realised, torch.tensor(want))
    assert stats.seen.tolist() == [False] + [True] * 5
    # an inactive row neither counts nor blocks containment; a round on finished rows only scores nothing
    before = stats.realised.clone()
    verify_round(budget, stats, pool, "2-2/2", draws, active=(False, False))
    assert torch.equal(stats.realised, before)
    verify_round(budget, stats, pool, "2/3", [[13, 0, 0, 0, 0], [12, 0, 0, 0, 0]], active=(False, True))
    got = stats.realised.tolist()
    # weights behind the means now: 2/3 first seen last round (R), 2/2 seen in both rounds ((1 - R) R + R)
    assert got[labels.index("2/3")] == pytest.approx(before[2] + weight(R) * (2 - before[2]))
    assert got[labels.index("2/2")] == pytest.approx(before[1] + weight((1 - R) * R + R) * (1 - before[1]))
    assert got[labels.index("2-2/3")] == before[4], "node 3 lies outside 2/3's tree: not contained"
