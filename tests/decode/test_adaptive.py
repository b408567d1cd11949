"""Context-aware speculation: dynamic (pruned, per-row) trees, merged drafters and the adaptive budget.

Exactness is tested as for any tree: greedy equality with transformers, seed-exact equality with the plain
sampler, and the exact law of the point-mass rule on pruned and merged toy trees (the G-test harness and its power
check live in ``test_verify``; the rows here differ in shape, which the fixed-tree cases there never do). The adaptive
round's fast paths against the general code are in ``test_adaptive_fast_paths``.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from longspec import (AdaptiveBudget, LongSpecDraft, LongSpecDrafter, MergedDrafter, PromptLookupDrafter,
                      SpeculativeDecoder, StreamingSelfDrafter, TreeSpec)
from longspec.decode.budget import BudgetOption, CostModel, Exploration, default_options, fit_line
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


def unit_costs(options, batches=(1, 2), per_node: float = 1.0, plain: float = 10.0) -> CostModel:
    """A cost model where a round costs ``10 + per_node * nodes`` us at any context, a plain one ``plain`` (the
    draft is free)."""
    verify = {b: {o.nodes: (plain, 0.0) if o.nodes == 1 else (10.0 + per_node * o.nodes, 0.0) for o in options}
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
    """Under a budget whose costs make it switch between options (and explore eagerly: a large bonus, a 2-round
    memory; plain rounds cost more than any tree, so it drafts), the output is transformers' greedy decoding; the stats carry one entry per
    round."""
    target = tiny_target(FAMILY)
    make, shape = DRAFTERS[case]
    ids, mask, want, scores = greedy_reference()
    budget = AdaptiveBudget(explore=2.0, window=2, budgets=(2, 4, 8), depths=(2,))
    budget.costs = unit_costs(default_options(TreeSpec(shape) if isinstance(shape, tuple) else shape, (2, 4, 8), (2,)),
                              per_node=0.3, plain=100.0)
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


@pytest.mark.parametrize("explore", [0.0, 4.0])
def test_adaptive_converges_to_plain_when_nothing_is_accepted(explore):
    """Prompt lookup on the tiny target accepts nothing here: after the opening rounds of the largest option (the
    first two: the host chooses one round ahead), the budget verifies plain rounds; with an optimism bonus (here a
    quarter token's gain times 4, times the price ratio: nothing was ever gained) it tries a tree again now and then,
    when its count has decayed, and without one never."""
    target = tiny_target(FAMILY)
    make, shape = DRAFTERS["pld"]
    ids, mask, want, scores = greedy_reference()
    budget = AdaptiveBudget(explore=explore, budgets=(2, 4, 8), depths=(2,))
    # a plain round costs 30% less than the smallest tree (an exploration has a price)
    budget.costs = unit_costs(default_options(TreeSpec(shape), (2, 4, 8), (2,)), per_node=0.3, plain=7.0)
    out = SpeculativeDecoder(target, make(target), tree_shape=shape, budget=budget).generate(
        ids, max_new_tokens=NEW, attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    chosen = out.stats.option_per_round
    assert all(t == 1.0 for t in out.stats.realised_tau), "the fixture should accept nothing"
    assert chosen[:2] == [budget.options[budget.largest].label] * 2
    later = chosen[2:]
    if explore == 0.0:
        assert later == ["plain"] * len(later)
    else:
        trees = len(later) - later.count("plain")
        assert 1 <= trees <= len(later) // 4, later


def test_saved_statistics_start_a_new_decoder_where_the_last_left_off(tmp_path):
    """A budget that learned that prompt lookup accepts nothing here saves its statistics; a new decoder's budget
    loaded from them verifies plain rounds from its first round on (a fresh one opens with two rounds of the largest
    option), and its output is still transformers' greedy decoding. Statistics saved for other options, or a file
    that is not one, are refused by name."""
    target = tiny_target(FAMILY)
    make, shape = DRAFTERS["pld"]
    ids, mask, want, scores = greedy_reference()
    options = default_options(TreeSpec(shape), (2, 4, 8), (2,))

    def decoder(**kw):
        budget = AdaptiveBudget(explore=0.0, budgets=(2, 4, 8), depths=(2,), **kw)
        budget.costs = unit_costs(options, per_node=0.3, plain=7.0)
        return SpeculativeDecoder(target, make(target), tree_shape=shape, budget=budget), budget

    first, budget = decoder()
    out = first.generate(ids, max_new_tokens=NEW, attention_mask=mask)
    assert out.stats.option_per_round[:2] == [budget.options[budget.largest].label] * 2
    path = tmp_path / "stats.pt"
    budget.save_stats(path)
    learned = {key: [t.clone() for t in s.tensors()] for key, s in budget._stats.items()}

    second, loaded = decoder(stats=path)
    out = second.generate(ids, max_new_tokens=NEW, attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    assert out.stats.option_per_round == ["plain"] * out.stats.rounds
    (key, stats), = loaded._stats.items()
    assert stats.seen.any() and torch.equal(stats.realised, learned[key][2])

    with pytest.raises(ValueError, match="saved for the options"):
        SpeculativeDecoder(target, make(target), tree_shape=shape,
                           budget=AdaptiveBudget(budgets=(2, 4), depths=(2,), stats=path))
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not statistics written by AdaptiveBudget.save_stats"):
        AdaptiveBudget(stats=tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match="no decoder yet"):
        AdaptiveBudget().save_stats(tmp_path / "none.pt")


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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_option_switches_are_exact(temperature):
    """Whatever option follows whatever (the choice replaced by a seeded random one: plain rounds on the decode path
    between pruned, cut, one-part and whole merged trees), greedy output is transformers' and seeded sampling is
    the plain sampler's."""
    import random

    target = tiny_target(FAMILY)
    make, spec = DRAFTERS["longspec+pld"]
    if temperature == 0.0:
        ids, mask, want, scores = greedy_reference()
        kw = dict(max_new_tokens=NEW, attention_mask=mask)
    else:
        ids, mask = ragged_batch([40, 29], seed=3, period=7)
        kw = dict(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=1234, attention_mask=mask)
        want, scores = SpeculativeDecoder(target, None).generate(ids, **kw).sequences, None
    for seed in range(2):
        rng = random.Random(seed)
        budget = AdaptiveBudget(budgets=(2, 4, 8), depths=(2,))
        budget.costs = unit_costs(default_options(spec, (2, 4, 8), (2,)), per_node=0.3)
        budget.choose = lambda *args, rng=rng, budget=budget: rng.randrange(len(budget.options))
        out = SpeculativeDecoder(target, make(target), tree_shape=spec, budget=budget).generate(ids, **kw)
        assert len(set(out.stats.option_per_round)) >= 4
        assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])


@pytest.mark.parametrize("case", ["longspec+pld"])
def test_adaptive_merged_sampling_is_seed_exact(case):
    """With a seed, the adaptive merged drafter emits exactly the plain sampler's tokens."""
    target = tiny_target(FAMILY)
    make, spec = DRAFTERS[case]
    ids, mask = ragged_batch([40, 29], seed=3, period=7)
    kw = dict(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=1234, attention_mask=mask)
    want = SpeculativeDecoder(target, None).generate(ids, **kw).sequences
    budget = AdaptiveBudget(explore=1.0, window=4, budgets=(2, 4, 8), depths=(2,))
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
    budget = AdaptiveBudget(budgets=(2, 8), depths=(1,), explore=0.0)
    budget.bind(spec)
    labels = [o.label for o in budget.options]
    assert labels == ["plain", "4/2", "4/5", "4-4/2", "4-4/8", "4-4/9"]
    costs = CostModel({1: {1: (10.0, 0.0), 2: (10.0, 0.0), 5: (10.0, 1e-4), 8: (10.0, 1e-4), 9: (10.0, 0.01)}},
                      {1: {"plain": (0.0, 0.0), "4": (1.0, 0.0), "4-4": (2.0, 0.0)}})
    costs.save(tmp_path / "c.json")
    budget.costs = CostModel.load(tmp_path / "c.json")
    assert budget.costs.to_json() == costs.to_json()
    realised = [1.0, 1.2, 1.9, 1.3, 2.6, 3.0]  # a depth-2 tree realises 3 at most
    seen = [True] * 6

    def choose(context, realised=realised, seen=seen, exploration=None):
        return labels[budget.choose(context, 1, realised, seen, exploration or Exploration([10.0] * 6, 10.0))]

    # short context: the whole tree costs about as much as anything else and yields most
    assert choose(100) == "4-4/9"
    # long context: its attention dominates; a smaller tree wins
    assert choose(100_000) == "4-4/8"
    # nothing drafted pays: plain rounds (tau exactly 1)
    assert choose(100_000, realised=[1.0] * 6) == "plain"
    # nothing seen yet: the largest, which surely holds (so scores) every option; the counts say so
    ex = Exploration([0.0] * 6)
    assert choose(100, seen=[False] * 6, exploration=ex) == "4-4/9"
    assert ex.rounds == 1.0 and ex.scored == [1.0] * 6
    # 4-4/8 surely holds plain's root and 4-4/2's nodes, not the depth-1 pool's (its 8 of 9 may leave one out)
    assert choose(100_000, exploration=ex) == "4-4/8"
    keep = 1.0 - 1.0 / budget.window
    assert ex.rounds == pytest.approx(1.0 + keep)
    assert ex.scored == pytest.approx([keep + 1.0, keep, keep, keep + 1.0, keep + 1.0, keep])
    # optimism: an option not scored lately (its count decayed) is tried again; without the bonus it is not
    stale = Exploration([10.0, 10.0, 10.0, 0.01, 10.0, 10.0], 10.0)
    assert choose(100_000, exploration=dataclasses.replace(stale)) == "4-4/8"
    budget.explore, budget.window = 1.0, 4
    assert choose(100_000, exploration=dataclasses.replace(stale)) == "4-4/2"
    # but never beyond what it can realise: 4/5 (depth 1) emits 2 tokens at most, 2 / 21 us < 2.6 / 22
    stale = Exploration([10.0, 10.0, 0.01, 10.0, 10.0, 10.0], 10.0)
    assert choose(100_000, exploration=dataclasses.replace(stale)) == "4-4/8"
    # exploring is priced: where nothing drafted pays (plain, 10 us, wins on the means), a stale 22 us tree's bonus
    # shrinks by 10 / 22 and plain stays; a stale 12 us option (the bonus by 10 / 12) is tried
    budget.explore, budget.window = 4.0, 16
    flat = [1.0, 1.0, 1.0, 1.0, 1.0, 1.05]
    assert choose(1000, realised=flat, exploration=Exploration([16.0] * 5 + [0.5], 16.0)) == "plain"
    assert choose(1000, realised=flat, exploration=Exploration([16.0] * 3 + [0.5, 16.0, 16.0], 16.0)) == "4-4/2"
    # an option scored every recent round (its count at the window) earns no bonus: a drafted option just short of a
    # plain round (1.09 / 11 us against 1 / 10) loses to it however large explore is, until its count decays
    budget.explore, budget.window = 5.0, 16
    short = [1.0, 1.09, 1.0, 1.0, 1.0, 1.0]
    assert choose(100_000, realised=short, exploration=Exploration([16.0] * 6, 16.0)) == "plain"
    decayed = Exploration([16.0, 0.5, 16.0, 16.0, 16.0, 16.0], 16.0)
    assert choose(100_000, realised=short, exploration=decayed) == "4/2"
    for bad, match in (({"explore": -1.0}, "explore must be"), ({"window": 0}, "window must be")):
        with pytest.raises(ValueError, match=match):
            AdaptiveBudget(**bad)
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
    # a sampled call calibrates its own verify costs (a draw costs more than an argmax) once, under its filters
    sampled = dict(max_new_tokens=6, attention_mask=mask, temperature=1.0, top_p=0.9, seed=3)
    dec.generate(ids, **sampled)
    tail = "sampled top_k=0 top_p=0.9"
    assert first.costs.covers(2, options, tail) and set(first.costs.sampled) == {tail}
    monkeypatch.setattr(SpeculativeDecoder, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    dec.generate(ids, **sampled)
    dec2.generate(ids, max_new_tokens=4, attention_mask=mask)
    assert second.costs.to_json()["verify"] == first.costs.to_json()["verify"]
    dec2.generate(ids, **sampled)  # from the file
    assert second.costs.to_json()["sampled"] == first.costs.to_json()["sampled"]


def test_sampled_rounds_are_chosen_at_sampled_costs(tmp_path):
    """Greedy and sampled rounds have their own verify costs: where a draw makes the tree round dearer, the same
    realised tau that pays greedy loses to a plain round when sampling; the tables survive a save and load."""
    spec = TreeSpec((1, 1, 1))
    budget = AdaptiveBudget(budgets=(2,), depths=(3,), explore=0.0)
    budget.bind(spec)
    labels = [o.label for o in budget.options]
    assert labels == ["plain", "1-1-1/2", "1-1-1/4"]
    greedy = {1: (1000.0, 0.0), 2: (1100.0, 0.0), 4: (1200.0, 0.0)}
    sampled = {1: (1200.0, 0.0), 2: (1500.0, 0.0), 4: (2000.0, 0.0)}
    tail = "sampled top_k=0 top_p=1"
    costs = CostModel({1: greedy}, {1: {"plain": (0.0, 0.0), "1-1-1": (20.0, 0.0)}}, {}, {tail: {1: sampled}})
    costs.save(tmp_path / "c.json")
    budget.costs = CostModel.load(tmp_path / "c.json")
    assert budget.costs.to_json() == costs.to_json()
    assert budget.costs.round_us(budget.options[2], 8192, 1, tail) == 2020.0
    assert budget.costs.covers(1, budget.options, tail) and not budget.costs.covers(1, budget.options, "sampled x")
    realised, seen = [1.0, 1.2, 1.6], [True] * 3
    assert labels[budget.choose(8192, 1, realised, seen, Exploration([1.0] * 3, 1.0))] == "1-1-1/4"
    assert labels[budget.choose(8192, 1, realised, seen, Exploration([1.0] * 3, 1.0), tail)] == "plain"


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
