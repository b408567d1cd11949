"""Device-side tree bookkeeping: masks and positions from parents, and beam-level expansion.

Nodes are flat in a :class:`~longspec.decode.drafter.TreeSpec`'s level order (root = 0); a pruned dynamic tree
(:func:`prune_tree`) keeps a subset in that order, so parents always come before their children. Everything here
is vectorised over the batch and the nodes of a level; the only Python loops run over depths, which are static.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .drafter import DraftTree, TreeSpec


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
    if all(n == 1 for n in spec.shape):  # a chain: every node's parent is the one before it
        return torch.ones(B, M, M, dtype=torch.bool, device=parents.device).tril_()
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


def tree_positions(seqlens: Tensor, depths: Tensor | TreeSpec, num_nodes: int | None = None) -> Tensor:
    """int64 ``[B, M]`` RoPE positions ``seqlens[b] + depth``: of the nodes with depths int64 ``[B, M]``, or of the
    first ``num_nodes`` nodes of a :class:`TreeSpec`'s level order."""
    if isinstance(depths, TreeSpec):
        depths = depths.depth_tensor(seqlens.device)[: num_nodes or depths.num_nodes][None, :]
    return seqlens.to(torch.int64)[:, None] + depths


def complete_tree(tree: DraftTree, spec: TreeSpec) -> DraftTree:
    """``tree`` with its mask and per-row depths filled in where the drafter left them out (from its parents and
    ``spec``'s level order), after checking the shapes against ``spec``. The engine verifies only complete trees."""
    B, T = tree.tokens.shape[0], spec.num_nodes
    if tree.tokens.shape != (B, T) or tree.parents.shape != (B, T):
        raise ValueError(f"the drafter must propose tokens and parents of shape [B, {T}], got "
                         f"{tuple(tree.tokens.shape)} and {tuple(tree.parents.shape)}")
    mask, depths = tree.mask, tree.depths
    if mask is None:
        mask = tree_mask_from_parents(tree.parents, spec)
    elif mask.shape != (B, T, T) or mask.dtype != torch.bool:
        raise ValueError(f"the drafter's tree mask must be bool [B, {T}, {T}], got {mask.dtype} {tuple(mask.shape)}")
    if depths is None:
        depths = spec.depth_tensor(tree.tokens.device).expand(B, T)
    elif depths.shape != (B, T):
        raise ValueError(f"the drafter's depths must be int64 [B, {T}], got {tuple(depths.shape)}")
    return DraftTree(tree.tokens, tree.parents, mask, depths, tree.scores, tree.sources)


def prune_tree(tree: DraftTree, keys: Tensor, nodes: int) -> DraftTree:
    """The ``nodes`` nodes of each row with the highest ``keys``: a dynamic tree within a node budget.

    Args:
        tree: a complete tree (:func:`complete_tree`) of P nodes, parents before children.
        keys: float ``[B, P]``: the root must rank first and no node above its parent (ties go to the earlier
            index, and parents come first), so the kept set contains every kept node's ancestors.
        nodes: the budget T <= P.

    Returns:
        a complete tree of T nodes per row, in the order of ``tree`` (so parents still come first), with its
        mask, depths, scores and sources gathered and parents renumbered; rows differ in shape.
    """
    return select_nodes(tree, kept_nodes(keys, nodes))


def kept_nodes(keys: Tensor, nodes: int) -> Tensor:
    """int64 ``[B, nodes]``: the pool indices :func:`prune_tree` keeps (the highest ``keys``), ascending."""
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :nodes]
    return order.sort(dim=1).values


def select_nodes(tree: DraftTree, sel: Tensor) -> DraftTree:
    """The subtree of the pool indices ``sel`` (int64 ``[B, T]``, ascending, ancestor-closed), parents
    renumbered."""
    B, P = tree.tokens.shape
    nodes = sel.shape[1]
    new_index = torch.full((B, P), -1, dtype=torch.int64, device=sel.device)
    new_index.scatter_(1, sel, torch.arange(nodes, device=sel.device).expand(B, nodes))
    parents = new_index.gather(1, tree.parents.gather(1, sel).clamp(min=0))
    parents[:, 0] = -1
    rows = tree.mask.gather(1, sel[:, :, None].expand(B, nodes, P))
    mask = rows.gather(2, sel[:, None, :].expand(B, nodes, nodes))

    def take(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.gather(1, sel)

    return DraftTree(take(tree.tokens), parents, mask, take(tree.depths), take(tree.scores), take(tree.sources))


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
