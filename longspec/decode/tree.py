"""Device-side tree bookkeeping: masks and positions from parents, and beam-level expansion.

Nodes are flat in a :class:`~longspec.decode.drafter.TreeSpec`'s level order (root = 0). Everything here is
vectorised over the batch and the nodes of a level; the only Python loops run over depths, which are static.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .drafter import TreeSpec


def tree_mask_from_parents(parents: Tensor, spec: TreeSpec) -> Tensor:
    """Ancestor-or-self mask of a (possibly partial) tree.

    Args:
        parents: int64 ``[B, M]`` parent indices in level order (``parents[:, 0]`` is ignored: the root);
            ``M`` may stop at any level boundary ``spec.offsets[d]`` (a tree under construction).
        spec: the layout (depth of each node).

    Returns:
        bool ``[B, M, M]``: ``mask[b, i, j]`` is True when node j is node i or one of its ancestors.
    """
    B, M = parents.shape
    mask = torch.eye(M, dtype=torch.bool, device=parents.device).expand(B, M, M).clone()
    # Level by level: a node's row is its parent's row (complete, since parents are one level up) plus itself.
    for d in range(1, spec.depth + 1):
        lo, hi = spec.offsets[d], min(spec.offsets[d + 1], M)
        if lo >= M:
            break
        par = parents[:, lo:hi]  # [B, n]
        par_rows = torch.gather(mask, 1, par[:, :, None].expand(B, hi - lo, M))
        mask[:, lo:hi] |= par_rows
    return mask


def tree_positions(seqlens: Tensor, spec: TreeSpec, num_nodes: int | None = None) -> Tensor:
    """int64 ``[B, M]`` RoPE positions of the first ``num_nodes`` nodes: ``seqlens[b] + depth``."""
    depths = spec.depth_tensor(seqlens.device)[: num_nodes or spec.num_nodes]
    return seqlens.to(torch.int64)[:, None] + depths[None, :]


def expand_level(cum_logp: Tensor, logp: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """One beam level: keep the global top-``width`` (parent, token) pairs by cumulative log-probability.

    Args:
        cum_logp: float ``[B, P]`` cumulative log-probability of the P parents (the previous level's nodes).
        logp: float ``[B, P, V]`` the drafter's log-probabilities of each parent's next token.
        width: children to keep (``<= P * V``).

    Returns:
        ``(parent [B, width] int64 in [0, P), token [B, width] int64, score [B, width] float)``, best first. Siblings
        are distinct tokens by construction (each (parent, token) pair appears once).
    """
    B, P, V = logp.shape
    # Two stages: a child in the global top-``width`` is in its own parent's top-``width`` (the parent's cumulative
    # log-probability shifts its whole row), so per-parent top-k (P rows in parallel) then a top-k over P * k
    # candidates select the same set as one top-k over all P * V pairs, which is one long serial row.
    k = min(width, V)
    child, token = torch.topk(logp, k, dim=-1)  # [B, P, k]
    top, idx = torch.topk((cum_logp[:, :, None] + child).reshape(B, P * k), width, dim=1)
    return idx // k, token.reshape(B, P * k).gather(1, idx), top


def prefix_tree_mask(prefix_len: Tensor, width: int, tree_mask: Tensor) -> Tensor:
    """Mask of a ``[prefix | tree]`` block: a causal prefix of ``prefix_len[b] <= width`` tokens, then the tree.

    Args:
        prefix_len: int ``[B]`` valid prefix tokens per row (slots ``[prefix_len, width)`` are padding).
        width: prefix slots R.
        tree_mask: bool ``[B, T, T]`` ancestor-or-self mask of the tree.

    Returns:
        bool ``[B, R + T, R + T]``: prefix token j sees valid prefix tokens ``<= j``; every tree node sees all valid
        prefix tokens plus its ancestors; a padding slot sees only itself and nothing sees it.
    """
    B, T, _ = tree_mask.shape
    dev = tree_mask.device
    j = torch.arange(width, device=dev)
    valid = j[None, :] < prefix_len[:, None]  # [B, R]
    causal = (j[:, None] >= j[None, :])[None] & valid[:, None, :] & valid[:, :, None]
    top = torch.cat([causal | torch.eye(width, dtype=torch.bool, device=dev), tree_mask.new_zeros(B, width, T)], 2)
    bottom = torch.cat([valid[:, None, :].expand(B, T, width), tree_mask], dim=2)
    return torch.cat([top, bottom], dim=1)
