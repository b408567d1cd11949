"""Tree masks, positions and beam-level expansion against naive formulations."""
from __future__ import annotations

import pytest
import torch

from longspec.decode.drafter import TreeSpec
from longspec.decode.tree import prefix_tree_mask, tree_mask_from_parents, tree_positions


def random_parents(spec: TreeSpec, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parents = torch.zeros(batch, spec.num_nodes, dtype=torch.int64)
    parents[:, 0] = -1
    for d in range(1, spec.depth + 1):
        lo, hi = spec.offsets[d - 1], spec.offsets[d]
        parents[:, spec.offsets[d] : spec.offsets[d + 1]] = lo + torch.randint(hi - lo, (batch, spec.shape[d - 1]),
                                                                               generator=g)
    return parents


def naive_mask(parents: torch.Tensor) -> torch.Tensor:
    B, T = parents.shape
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = int(parents[b, j])
    return mask


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (4, 16, 16, 16, 16), (3, 1, 5)])
def test_mask_is_the_ancestor_closure(shape):
    spec = TreeSpec(shape)
    parents = random_parents(spec, batch=3, seed=len(shape))
    mask = tree_mask_from_parents(parents, spec)
    assert torch.equal(mask, naive_mask(parents))
    for d in range(1, spec.depth + 1):  # a partial tree (levels < d) gives the leading block
        n = spec.offsets[d]
        assert torch.equal(tree_mask_from_parents(parents[:, :n], spec), mask[:, :n, :n])


def test_paper_tree_layout_and_positions():
    spec = TreeSpec((4, 16, 16, 16, 16))
    assert spec.num_nodes == 69 and spec.offsets == (0, 1, 5, 21, 37, 53, 69)
    pos = tree_positions(torch.tensor([10, 0], dtype=torch.int32), spec)
    assert pos.shape == (2, 69)
    assert pos[0, 0] == 10 and pos[0, 4] == 11 and pos[0, 68] == 15 and pos[1, 21] == 3


def test_prefix_tree_mask():
    spec = TreeSpec((2, 2))
    parents = random_parents(spec, batch=2, seed=4)
    tree = tree_mask_from_parents(parents, spec)
    R, T = 3, spec.num_nodes
    mask = prefix_tree_mask(torch.tensor([2, 0]), R, tree)
    want = torch.zeros(2, R + T, R + T, dtype=torch.bool)
    for b, n in enumerate([2, 0]):
        for i in range(R):
            want[b, i, i] = True
            if i < n:
                want[b, i, :i + 1] = True
        want[b, R:, :n] = True
        want[b, R:, R:] = tree[b]
    assert torch.equal(mask, want)
