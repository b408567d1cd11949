"""Context-aware speculation: dynamic (pruned, per-row) trees, merged drafters and the adaptive budget.

Exactness is tested as for any tree: greedy equality with transformers, seed-exact equality with the plain
sampler, and the exact law of the point-mass rule on pruned and merged toy trees (the G-test harness and its power
check live in ``test_verify``; the rows here differ in shape, which the fixed-tree cases there never do).
"""
from __future__ import annotations

import functools
import itertools

import pytest
import torch

from longspec import (AdaptiveBudget, LongSpecDraft, LongSpecDrafter, MergedDrafter, PromptLookupDrafter,
                      SpeculativeDecoder, StreamingSelfDrafter, TreeSpec)
from longspec.decode.budget import BudgetOption, CostModel, default_options, fit_line
from longspec.decode.drafter import DraftTree
from longspec.decode.merge import merge_trees
from longspec.decode.sampling import SamplingParams
from longspec.decode.tree import complete_tree, prune_tree
from longspec.decode.verify import accept_tree, node_draws

from .test_tree import naive_mask, random_parents
from .test_verify import ALPHA, N_TRIALS, g_test_pvalue
from .tiny_targets import assert_same_tokens, hf_greedy, ragged_batch, tiny_target

NEW = 24
FAMILY = "llama-gqa-d64"


def unit_costs(options, batches=(1, 2), per_node: float = 1.0) -> CostModel:
    """A cost model where a round costs ``10 + per_node * nodes`` us at any context (the draft is free)."""
    verify = {b: {o.nodes: (10.0, 0.0) if o.nodes == 1 else (10.0 + per_node * o.nodes, 0.0) for o in options}
              for b in batches}
    draft = {b: {o.draft_key: (0.0, 0.0) for o in options} for b in batches}
    return CostModel(verify, draft, {"source": "test"})


# --- layouts, pruning and merging ------------------------------------------------------------------------------------


def test_merged_layout_parts_and_truncation():
    spec = TreeSpec.merged((2, 3), (1, 1, 1))
    assert spec.shape == (3, 4, 1) and spec.num_nodes == 9
    assert spec.part_nodes() == [[0, 1, 2, 4, 5, 6], [0, 3, 7, 8]]
    assert spec.node_parts() == (0, 0, 0, 1, 0, 0, 0, 1, 1)
    assert spec.truncate(2) == TreeSpec((3, 4), ((2, 3), (1, 1)))
    assert [s.shape if s else None for s in TreeSpec.merged((2,), ()).part_specs()] == [(2,), None]
    with pytest.raises(ValueError, match="two or more"):
        TreeSpec.merged((2, 3))
    with pytest.raises(ValueError, match="elementwise sum"):
        TreeSpec((3, 3), ((2, 3), (1, 1)))
    with pytest.raises(ValueError, match="depth must be"):
        spec.truncate(4)


def test_prune_tree_keeps_an_ancestor_closed_tree_per_row():
    """Each row keeps its own best nodes; parents come first, depths and mask follow the renumbered parents."""
    spec = TreeSpec((3, 5, 6))
    g = torch.Generator().manual_seed(0)
    B, T = 4, spec.num_nodes
    parents = random_parents(spec, B, seed=0)
    tokens = torch.randint(0, 50, (B, T), generator=g)
    tree = complete_tree(DraftTree(tokens, parents), spec)
    raw = torch.rand(B, T, generator=g)
    raw[:, 0] = 2.0
    keys = torch.where(tree.mask, raw[:, None, :], torch.full_like(raw, 9.0)[:, None, :]).amin(dim=-1)
    tree.scores = keys  # carried through the pruning: the kept nodes' keys
    out = prune_tree(tree, keys, 7)
    assert out.tokens.shape == (B, 7) and out.mask.shape == (B, 7, 7)
    assert torch.equal(out.mask, naive_mask(out.parents))
    assert (out.parents[:, 1:] < torch.arange(1, 7)).all() and (out.parents[:, 0] == -1).all()
    assert torch.equal(out.depths[:, 1:], out.depths.gather(1, out.parents[:, 1:]) + 1)
    assert torch.equal(out.scores.sort(dim=1).values, keys.topk(7, dim=1).values.sort(dim=1).values)
    assert not all(torch.equal(out.parents[0], out.parents[b]) for b in range(1, B)), "rows should differ"


def test_merge_trees_deduplicates_by_prefix():
    """Two parts proposing the same path give one candidate: the later twin scores -inf and loses its children to
    the first, which carries both parts' bits."""
    spec = TreeSpec.merged((2, 2), (1, 1))
    root = torch.tensor([5])
    a = DraftTree(torch.tensor([[5, 7, 8, 9, 3]]), torch.tensor([[-1, 0, 0, 1, 2]]),
                  scores=torch.tensor([[0.0, -0.1, -0.2, -0.3, -0.4]]))
    b = DraftTree(torch.tensor([[5, 7, 4]]), torch.tensor([[-1, 0, 1]]), scores=torch.tensor([[0.0, 0.0, 0.0]]))
    trees = [complete_tree(a, s) for s, a in zip(spec.part_specs(), (a, b))]
    m = merge_trees(root, trees, spec)
    # layout: root | 7 8 (a) 7 (b) | 9 3 (a) 4 (b)
    assert m.tokens.tolist() == [[5, 7, 8, 7, 9, 3, 4]]
    assert m.parents.tolist() == [[-1, 0, 0, 0, 1, 2, 1]]  # b's 4 now hangs under a's 7
    assert m.sources.tolist() == [[0, 3, 1, 0, 1, 1, 2]]  # the twin keeps none: the first speaks for both
    assert m.scores[0, 3] == float("-inf") and m.scores[0, 1] == -0.1
    assert torch.equal(m.mask, naive_mask(m.parents))
    # greedy: the target continues 7 4, which only part b proposed; the merged tree accepts both
    draws = torch.tensor([[7, 4, 0, 0, 0, 0, 1]])
    acc = accept_tree(m.tokens, m.parents, m.mask, draws, spec)
    assert acc.accept_len.tolist() == [3] and acc.emitted[0].tolist() == [7, 4, 1]


# --- the exact law on pruned and merged trees ------------------------------------------------------------------------


def exact_law(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """float64 [T * V]: P(deepest node = u, bonus = y) for one tree (parents before children) and per-node p."""
    T, V = p.shape
    reach = torch.zeros(T, dtype=torch.float64)
    reach[0] = 1.0
    law = torch.zeros(T, V, dtype=torch.float64)
    for u in range(T):
        kids: dict[int, int] = {}
        for c in range(1, T):
            if int(parents[c]) == u:
                kids.setdefault(int(tokens[c]), c)
        for y in range(V):
            if y in kids:
                reach[kids[y]] += reach[u] * float(p[u, y])
            else:
                law[u, y] = reach[u] * float(p[u, y])
    return law.reshape(-1)


def toy_pool(spec: TreeSpec, vocab: int, rows: int, seed: int) -> DraftTree:
    """Random level-order trees (duplicate siblings likely) with per-row tokens and parents."""
    g = torch.Generator().manual_seed(seed)
    T = spec.num_nodes
    parents = random_parents(spec, rows, seed)
    tokens = torch.randint(0, min(vocab, 5), (rows, T), generator=g)
    return complete_tree(DraftTree(tokens, parents, scores=-torch.rand(rows, T, generator=g)), spec)


def node_p(T: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    conc = torch.rand(T, vocab, generator=g) ** 3
    conc[torch.rand(T, vocab, generator=g) < 0.2] = 0.0
    conc[:, 0] += 0.05
    return conc / conc.sum(dim=1, keepdim=True)


def dynamic_trees(kind: str) -> tuple[DraftTree, int]:
    """Two different trees (rows 0 and 1) of one node count: pruned from a pool, or merged from two parts."""
    V = 8
    if kind == "pruned":
        spec = TreeSpec((3, 5, 4))
        pool = toy_pool(spec, V, 2, seed=1)
        raw = torch.rand(2, spec.num_nodes, generator=torch.Generator().manual_seed(2))
        raw[:, 0] = 2.0
        keys = torch.where(pool.mask, raw[:, None, :], torch.full_like(raw, 9.0)[:, None, :]).amin(dim=-1)
        return prune_tree(pool, keys, 7), V
    spec = TreeSpec.merged((2, 3), (1, 1, 1))
    parts = [toy_pool(s, V, 2, seed=3 + i) for i, s in enumerate(spec.part_specs())]
    return merge_trees(torch.zeros(2, dtype=torch.int64), parts, spec), V


@pytest.mark.parametrize("kind", ["pruned", "merged"])
def test_point_mass_rule_is_exact_on_dynamic_trees(kind):
    """N = 200,000 trials per row tree (rows of one batch hold different trees, depths given per row); G-test of
    (deepest node, bonus) against the exact law, alpha = 1e-3 over the four cells tested here. Detects TV >= 0.014
    at power 0.99 (``test_verify.min_detectable_tv``); ``test_verify.test_harness_power`` shows the harness rejects
    the known-bad rules."""
    tree, V = dynamic_trees(kind)
    T = tree.tokens.shape[1]
    p = torch.stack([node_p(T, V, seed=10), node_p(T, V, seed=11)])  # [2, T, V]
    D = int(tree.depths.max())
    n = N_TRIALS
    rows = torch.arange(n) % 2
    logits = p.log()[rows]
    seqlens = torch.zeros(n, dtype=torch.int32)
    params = SamplingParams(temperature=1.0, seed=99)
    draws = node_draws(logits, params, seqlens, tree.depths[rows], None, max_depth=D)
    acc = accept_tree(tree.tokens[rows], tree.parents[rows], tree.mask[rows], draws, tree.depths[rows], max_depth=D)
    last = (acc.accept_len - 1)[:, None]
    cell = acc.accept_index.gather(1, last)[:, 0] * V + acc.emitted.gather(1, last)[:, 0]
    for r in range(2):
        law = exact_law(tree.tokens[r], tree.parents[r], p[r].double())
        counts = torch.bincount(cell[rows == r], minlength=T * V)
        pv = g_test_pvalue(counts, law)
        assert pv > ALPHA / 4, f"row {r}: G-test p = {pv:.3g}"


# --- the engine: exactness with budgets and merged trees --------------------------------------------------------------


def longspec_drafter(target, window: int = 16) -> LongSpecDrafter:
    """A random LongSpec draft (every parameter drawn, so it proposes something other than noise-free ties)."""
    draft = LongSpecDraft.from_target(target, window=window)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return LongSpecDrafter(draft)


# case -> (drafter factory, tree shape)
DRAFTERS = {
    "pld": (lambda t: PromptLookupDrafter(), (3, 3, 3, 3)),
    "streaming+pld": (lambda t: MergedDrafter(StreamingSelfDrafter(sink=4, window=256), PromptLookupDrafter()),
                      TreeSpec.merged((2, 3, 3), (1, 1, 1, 1))),
    "longspec+pld": (lambda t: MergedDrafter(longspec_drafter(t), PromptLookupDrafter()),
                     TreeSpec.merged((3, 4, 4), (1, 1, 1, 1))),
}


@functools.lru_cache(maxsize=None)
def greedy_reference():
    ids, mask = ragged_batch([70, 45], seed=11, period=13)
    want, scores = hf_greedy(tiny_target(FAMILY), ids, mask, NEW)
    return ids, mask, want, scores


@pytest.mark.parametrize("case", list(DRAFTERS))
def test_adaptive_greedy_matches_transformers(case):
    """Under a budget whose costs make it switch between options (and explore every 3 rounds), the output is
    transformers' greedy decoding; the stats carry one entry per round."""
    target = tiny_target(FAMILY)
    make, shape = DRAFTERS[case]
    ids, mask, want, scores = greedy_reference()
    budget = AdaptiveBudget(explore_every=3, budgets=(2, 4, 8), depths=(2,))
    budget.costs = unit_costs(default_options(TreeSpec(shape) if isinstance(shape, tuple) else shape, (2, 4, 8), (2,)),
                              per_node=0.3)
    dec = SpeculativeDecoder(target, make(target), tree_shape=shape, budget=budget)
    out = dec.generate(ids, max_new_tokens=NEW, attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    s = out.stats
    assert len(s.nodes_per_round) == len(s.predicted_tau) == len(s.realised_tau) == len(s.option_per_round) == s.rounds
    labels = {o.label: o.nodes for o in budget.options}
    assert [labels[o] for o in s.option_per_round] == s.nodes_per_round  # the chosen option, round by round
    assert len(set(s.nodes_per_round)) >= 2, "the budget never changed the tree"
    assert all(t >= 1.0 for t in s.predicted_tau)
    assert max(max(row) for row in out.accept_lengths) >= 2


def forced_options(spec: TreeSpec) -> dict[str, BudgetOption]:
    """One option of each kind (a budget of one option verifies it every round)."""
    return {
        "plain": BudgetOption(None, 1),
        "depth2-pruned": BudgetOption(spec.truncate(2), 4),
        "part1-only": BudgetOption(TreeSpec(spec.parts[1], ((),) + (spec.parts[1],)), 3),
        "whole": BudgetOption(spec, spec.num_nodes),
    }


@pytest.mark.parametrize("option", ["plain", "depth2-pruned", "part1-only", "whole"])
def test_every_option_kind_is_exact(option):
    """Each kind of option, verified every round (the drafters catch up through ``observe`` when left out)."""
    target = tiny_target(FAMILY)
    make, spec = DRAFTERS["longspec+pld"]
    ids, mask, want, scores = greedy_reference()
    chosen = forced_options(spec)[option]
    budget = AdaptiveBudget(unit_costs([chosen]), options=[chosen])
    out = SpeculativeDecoder(target, make(target), tree_shape=spec, budget=budget).generate(
        ids, max_new_tokens=NEW, attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    assert set(out.stats.nodes_per_round) == {chosen.nodes} and set(out.stats.option_per_round) == {chosen.label}


@pytest.mark.parametrize("case", ["longspec+pld"])
def test_adaptive_merged_sampling_is_seed_exact(case):
    """With a seed, the adaptive merged drafter emits exactly the plain sampler's tokens."""
    target = tiny_target(FAMILY)
    make, spec = DRAFTERS[case]
    ids, mask = ragged_batch([40, 29], seed=3, period=7)
    kw = dict(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=1234, attention_mask=mask)
    want = SpeculativeDecoder(target, None).generate(ids, **kw).sequences
    budget = AdaptiveBudget(explore_every=3, budgets=(2, 4, 8), depths=(2,))
    budget.costs = unit_costs(default_options(spec, (2, 4, 8), (2,)), per_node=0.3)
    out = SpeculativeDecoder(target, make(target), tree_shape=spec, budget=budget).generate(ids, **kw)
    assert_same_tokens(out.sequences, want)


# --- costs and the choice ---------------------------------------------------------------------------------------------


def test_cost_model_fit_roundtrip_and_choice(tmp_path):
    assert fit_line([(1000, 12.0), (3000, 16.0)]) == pytest.approx((10.0, 0.002))
    assert fit_line([(5, 3.0), (5, 5.0)]) == (4.0, 0.0)
    a, b = fit_line([(0, 1.0), (10, -5.0)])  # never a falling cost
    assert a >= 0 and b >= 0
    spec = TreeSpec((4, 4))
    budget = AdaptiveBudget(budgets=(2, 8), depths=(1,), explore_every=0)
    budget.bind(spec)
    labels = [o.label for o in budget.options]
    assert labels == ["plain", "4/2", "4/5", "4-4/2", "4-4/8", "4-4/9"]
    costs = CostModel({1: {1: (10.0, 0.0), 2: (10.0, 0.0), 5: (10.0, 1e-4), 8: (10.0, 1e-4), 9: (10.0, 0.01)}},
                      {1: {"plain": (0.0, 0.0), "4": (1.0, 0.0), "4-4": (2.0, 0.0)}})
    costs.save(tmp_path / "c.json")
    budget.costs = CostModel.load(tmp_path / "c.json")
    assert budget.costs.to_json() == costs.to_json()
    curve = [1.0, 1.2, 1.9, 1.3, 2.8, 3.2]
    seen = [True] * 6
    # short context: the whole tree costs about as much as anything else and yields most
    assert labels[budget.choose(100, 1, curve, seen, 0)] == "4-4/9"
    # long context: its attention dominates; a smaller tree wins
    assert labels[budget.choose(100_000, 1, curve, seen, 0)] == "4-4/8"
    # nothing seen yet, or time to explore: the largest
    assert budget.choose(100, 1, curve, [False] * 6, 0) == budget.largest
    budget.explore_every = 4
    assert budget.choose(100_000, 1, curve, seen, 4) == budget.largest
    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.from_json({"verify": 3})


def test_calibration_runs_once_and_is_cached(tmp_path, monkeypatch):
    """Without costs the first generate calibrates (on whatever device) and caches per model shape; a second
    decoder of that shape loads the file instead."""
    target = tiny_target(FAMILY)
    ids, mask, want, scores = greedy_reference()
    spec = TreeSpec((2, 2))
    options = [BudgetOption(None, 1), BudgetOption(spec, 4), BudgetOption(spec, spec.num_nodes)]
    first = AdaptiveBudget(options=options, cache_dir=tmp_path)
    dec = SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=spec, budget=first)
    out = dec.generate(ids, max_new_tokens=8, attention_mask=mask)
    assert_same_tokens(out.sequences, want[:, : ids.shape[1] + 8])
    assert first.costs.covers(2, options) and len(list((tmp_path / "costs").iterdir())) == 1
    second = AdaptiveBudget(options=options, cache_dir=tmp_path)
    dec2 = SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=spec, budget=second)
    monkeypatch.setattr(SpeculativeDecoder, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    dec2.generate(ids, max_new_tokens=4, attention_mask=mask)
    assert second.costs.to_json()["verify"] == first.costs.to_json()["verify"]


def test_bad_budget_arguments():
    target = tiny_target(FAMILY)
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeDecoder(target, None, budget=AdaptiveBudget())
    with pytest.raises(TypeError, match="AdaptiveBudget"):
        SpeculativeDecoder(target, PromptLookupDrafter(), budget="auto")
    with pytest.raises(ValueError, match="depth-truncated prefix"):
        SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=(2, 2),
                           budget=AdaptiveBudget(options=[BudgetOption(TreeSpec((3,)), 2)]))
    with pytest.raises(ValueError, match="budgets must be"):
        AdaptiveBudget(budgets=(0,))
    with pytest.raises(ValueError, match="one shape per drafter"):
        SpeculativeDecoder(target, MergedDrafter(PromptLookupDrafter(), PromptLookupDrafter()),
                           tree_shape=(2, 2)).generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="two or more"):
        MergedDrafter(PromptLookupDrafter())


# --- the adaptive round's fast paths against the general code -------------------------------------------------------


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


def loop_shape(budget: AdaptiveBudget, stats, pool: DraftTree, index: int, active: torch.Tensor):
    """AdaptiveBudget.shape as it was first written (one sort per group, one update per option), the reference for
    the batched version: returns (tree, predicted tau) and updates stats.curve / stats.seen."""
    from longspec.decode.budget import CURVE_RATE, _part_bits

    option = budget.options[index]
    p = stats.estimate(stats.keys(pool.depths, pool.scores, pool.sources))
    p[:, 0] = 1.0
    p = torch.where(pool.mask, p[:, None, :], torch.ones_like(p)[:, None, :]).amin(dim=-1)
    weight = active.float() / active.float().sum().clamp(min=1.0)
    groups: dict[tuple, list] = {}
    for j, o in enumerate(budget.options):
        if o.spec is None or o.spec.depth > option.spec.depth:
            continue
        bits = _part_bits(o.spec)
        if bits & ~_part_bits(option.spec) or any(len(a) > len(b) for a, b in zip(o.spec.parts, option.spec.parts)):
            continue
        groups.setdefault((o.spec.depth, bits), []).append((j, o.nodes))
    predicted = None
    for (depth, bits), members in groups.items():
        member = (pool.depths <= depth) & (((pool.sources & bits) != 0) | (pool.depths == 0))
        ranked = torch.sort(torch.where(member, p, -1.0), dim=1, descending=True).values.clamp(min=0)
        taus = (ranked.cumsum(dim=1) * weight[:, None]).sum(dim=0)
        for j, nodes in members:
            rate = CURVE_RATE if stats.seen[j] else 1.0
            stats.curve[j] = (1 - rate) * stats.curve[j] + rate * taus[nodes - 1]
            stats.seen[j] = True
            if j == index:
                predicted = taus[nodes - 1]
    return prune_tree(pool, p, option.nodes), predicted


@pytest.mark.parametrize("label", ["3-4-4|1-1-1-1/8", "3-4-4|1-1-1-1/16", "3-4|1-1/4", "none|1-1-1-1/5", "3-4-4|none/8"])
def test_batched_shape_matches_the_loop(label):
    """The batched AdaptiveBudget.shape keeps the same nodes, predicts the same tau and moves every option's curve
    and seen flag as the per-group loop did, over two rounds (so both curve rates are used); the keys it hands the
    tail are the kept nodes' statistics cells."""
    from longspec.decode.budget import AcceptanceStats

    spec = TreeSpec.merged((3, 4, 4), (1, 1, 1, 1))
    budget = AdaptiveBudget(budgets=(2, 4, 8), depths=(2,))
    budget.bind(spec)
    index = [o.label for o in budget.options].index(label)
    drafted = budget.options[index].spec
    g = torch.Generator().manual_seed(3)
    new, ref = (AcceptanceStats(2, spec.depth, len(budget.options), torch.device("cpu")) for _ in range(2))
    counts = torch.rand(2, new.proposed.numel(), generator=g) * 10
    for s in (new, ref):
        s.proposed.copy_(counts[0] + counts[1])
        s.accepted.copy_(counts[1])
    active = torch.tensor([True, False, True])
    for round_ in range(2):
        parts = [distinct_pool(s, 3, seed=10 * round_ + i) if s is not None else None
                 for i, s in enumerate(drafted.part_specs())]
        pool = merge_trees(torch.zeros(3, dtype=torch.int64), parts, drafted)
        tree, predicted, keys = budget.shape(new, pool, index, active)
        want, want_predicted = loop_shape(budget, ref, pool, index, active)
        for name in ("tokens", "parents", "mask", "depths", "scores", "sources"):
            assert torch.equal(getattr(tree, name), getattr(want, name)), name
        torch.testing.assert_close(predicted, want_predicted)
        torch.testing.assert_close(new.curve, ref.curve)
        assert torch.equal(new.seen, ref.seen) and new.seen.sum() >= 2
        assert torch.equal(keys, new.keys(tree.depths, tree.scores, tree.sources))
    # a round on finished rows only (the one generate runs ahead at its end) moves no curve and marks nothing seen
    curve, seen = new.curve.clone(), new.seen.clone()
    budget.shape(new, pool, index, torch.zeros(3, dtype=torch.bool))
    assert torch.equal(new.curve, curve) and torch.equal(new.seen, seen)
    fresh = AcceptanceStats(2, spec.depth, len(budget.options), torch.device("cpu"))
    budget.shape(fresh, pool, index, torch.zeros(3, dtype=torch.bool))
    assert not fresh.seen.any() and (fresh.curve == 1.0).all()
