"""PromptLookupDrafter: matching, ranking and the trie layout, on hand-made contexts."""
from __future__ import annotations

import torch

from longspec import PromptLookupDrafter
from longspec.decode.drafter import DecodeState, TreeSpec


def state_for(rows: list[list[int]], width: int = 40) -> DecodeState:
    """A DecodeState whose rows hold ``rows`` (last token = the root); only tokens/seqlens/root are read."""
    B = len(rows)
    tokens = torch.full((B, width), 0, dtype=torch.int64)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r)
    seqlens = torch.tensor([len(r) - 1 for r in rows], dtype=torch.int32)
    root = torch.tensor([r[-1] for r in rows])

    class _Cache:  # the drafter only reads seqlens
        pass

    cache = _Cache()
    cache.seqlens = seqlens
    return DecodeState(target=None, cache=cache, tokens=tokens, root=root, active=torch.ones(B, dtype=torch.bool))


def check_well_formed(tree, spec: TreeSpec) -> None:
    depth = spec.depth_tensor("cpu")
    assert tree.tokens.shape == tree.parents.shape == (tree.tokens.shape[0], spec.num_nodes)
    assert (tree.parents[:, 0] == -1).all()
    assert (depth[tree.parents[:, 1:]] == depth[1:] - 1).all()


def test_chain_copies_the_longest_most_recent_match():
    # "7 8 9" occurs twice; its latest occurrence continues with 4 5 6; a 1-gram match on 9 would also continue
    row = [7, 8, 9, 1, 2, 3, 3, 7, 8, 9, 4, 5, 6, 0, 8, 9, 11, 7, 8, 9]
    spec = TreeSpec((1, 1, 1))
    tree = PromptLookupDrafter(max_ngram=3).propose(state_for([row]), spec)
    check_well_formed(tree, spec)
    assert tree.tokens[0].tolist() == [9, 4, 5, 6]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2]


def test_continuation_repeats_its_period_past_the_root():
    # the latest "1 2 3" ends one period (3 tokens) before the root: the chain goes on repeating "1 2 3"; a row
    # whose match is older copies straight on, and a row without a match drafts fillers (-inf)
    rows = [[5, 1, 2, 3, 1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3], [4, 5, 6]]
    spec = TreeSpec((1,) * 7)
    tree = PromptLookupDrafter(max_ngram=3).propose(state_for(rows), spec)
    check_well_formed(tree, spec)
    assert tree.tokens[0].tolist() == [3, 1, 2, 3, 1, 2, 3, 1]
    assert tree.tokens[1].tolist() == [3, 4, 5, 6, 7, 8, 9, 0]
    assert torch.isfinite(tree.scores[:2]).all() and torch.isinf(tree.scores[2, 1:]).all()
    # the same rows through the trie (a tree spec), best candidate along index 0 of every level
    tree = PromptLookupDrafter(max_ngram=3).propose(state_for(rows[:1]), TreeSpec((2,) * 7))
    assert tree.tokens[0, [0, 1, 3, 5, 7, 9, 11, 13]].tolist() == [3, 1, 2, 3, 1, 2, 3, 1]


def test_tree_branches_with_distinct_siblings_and_fills_empty_slots():
    # root 5; "5" is followed by 1 (twice: "1 2" and "1 3") and by 6 → depth 1: {1, 6}; depth 2 under 1: {2, 3}
    rows = [[5, 1, 2, 0, 5, 6, 0, 5, 1, 3, 0, 5], [10, 11, 12, 13]]  # row 1: no match at all
    spec = TreeSpec((3, 3))
    tree = PromptLookupDrafter(max_ngram=2, min_ngram=1).propose(state_for(rows), spec)
    check_well_formed(tree, spec)
    t, p = tree.tokens[0].tolist(), tree.parents[0].tolist()
    assert t[0] == 5
    level1 = t[1:4]
    assert level1[:2] == [1, 6] or level1[:2] == [6, 1]
    assert len(set(level1[:2])) == 2
    one = 1 + level1.index(1)
    children_of_one = sorted(t[i] for i in range(4, 7) if p[i] == one)
    assert children_of_one[:2] == [2, 3]
    # row 1: every slot is a filler hanging off the previous level's first node
    assert tree.parents[1].tolist() == [-1, 0, 0, 0, 1, 1, 1]


def test_match_must_end_before_the_root_and_respect_min_ngram():
    # the only earlier "4" is too short for min_ngram=2; the 2-gram "3 4" occurs once before the end
    row = [1, 3, 4, 9, 2, 4, 8, 3, 4]
    spec = TreeSpec((1, 1))
    tree = PromptLookupDrafter(max_ngram=2, min_ngram=2).propose(state_for([row]), spec)
    assert tree.tokens[0].tolist() == [4, 9, 2]
    tree = PromptLookupDrafter(max_ngram=1, min_ngram=1).propose(state_for([row]), spec)
    assert tree.tokens[0].tolist() == [4, 8, 3]  # most recent 1-gram match: "4" at index 5


def test_chain_fast_path_equals_the_trie():
    """A chain spec takes the fused ``prompt_lookup_chain`` op (the best candidate alone), which must build exactly
    the trie's tree from the same candidate: random texts (short alphabets, so matches of every length and
    periods), rows without a match, roots at every column."""
    from longspec.decode.pld import _trie
    from longspec_ops.reference import lookup

    g = torch.Generator().manual_seed(0)
    pld = PromptLookupDrafter()
    for depth in (1, 2, 5, 8):
        spec = TreeSpec((1,) * depth)
        B, C = 24, 30
        rows = [torch.randint(0, 2 + b % 6, (int(n),), generator=g).tolist()
                for b, n in enumerate(torch.randint(1, C, (B,), generator=g))]
        rows[0] = [7, 8, 9]  # no match at all
        state = state_for(rows, width=C)
        tree = pld.propose(state, spec)
        ctx, last = state.tokens, state.seqlens.to(torch.int64)
        top, start = torch.topk(lookup.start_scores(ctx, last, 1, 3), 1, dim=1)
        cont, valid = lookup.continuations(ctx, last, start, top >= 0, depth)
        want = _trie(state.root, cont, valid, spec)
        assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents)
        assert torch.equal(tree.scores, want.scores), depth
