"""Lossless tree verification: the point-mass ("target-only") rule in its "draw y ~ p once per node" form.

At a node u, draw y ~ p_u (the processed target distribution at u; argmax at T = 0). If y is the token of one of
u's children, descend into the first such child in index order; otherwise emit y as the bonus and stop. This is
the sequential rule "accept child x with probability p_res(x), else zero it and renormalise; bonus from the final
residual" (``reference/verification.md`` rule 4), so the emitted tokens follow the target's law exactly; no draft
probabilities are needed, duplicate siblings are never taken twice, and at T = 0 it is exact greedy verification.

Drawing y at every node at once (independent draws; only those on the taken path matter) makes the whole rule a
few batched tensor ops: no loop over rows or nodes, no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .drafter import TreeSpec
from .sampling import NoiseKey, SamplingParams, sample_tokens


@dataclass
class Acceptance:
    """The outcome of verifying one tree per row (D = tree depth).

    accept_index: int64 ``[B, D + 1]`` node indices of the accepted path, root first; valid up to accept_len.
    accept_len:   int64 ``[B]`` accepted path length including the root, in ``[1, D + 1]``.
    emitted:      int64 ``[B, D + 1]`` tokens this round emits: the accepted drafts then the bonus token;
                  ``emitted[b, :accept_len[b]]`` are valid.
    """

    accept_index: Tensor
    accept_len: Tensor
    emitted: Tensor


def node_draws(
    logits: Tensor,
    params: SamplingParams,
    seqlens: Tensor,
    depths: Tensor | TreeSpec,
    generator: Optional[torch.Generator] = None,
    seed: Optional[NoiseKey] = None,
    max_depth: Optional[int] = None,
) -> Tensor:
    """y ~ p at every node: int64 ``[B, T]`` from target logits ``[B, T, V]``.

    ``depths``: the nodes' depths, int64 ``[B, T]`` (a dynamic tree; then ``max_depth`` bounds them), or a
    :class:`TreeSpec` (its level-order depths for every row). Node i sits at position ``seqlens[b] + depth(i)``, so
    its draw is the token at ``seqlens[b] + depth(i) + 1``: the same position key the plain sampler uses there
    (seed-exact mode). ``seed``: as in :func:`~longspec.decode.sampling.sample_tokens`.
    """
    depth, D = _depths(depths, max_depth, logits.device)
    positions = seqlens.to(torch.int64)[:, None] + torch.arange(1, D + 2, device=logits.device)
    return sample_tokens(logits, params, positions, generator, position_index=depth, seed=seed)


def _depths(depths: Tensor | TreeSpec, max_depth: Optional[int], device: torch.device) -> tuple[Tensor, int]:
    """(depths, max depth): a TreeSpec's int64 ``[T]`` and its depth, or the given ``[B, T]`` and ``max_depth``."""
    if isinstance(depths, TreeSpec):
        return depths.depth_tensor(device), depths.depth
    if max_depth is None:
        raise ValueError("max_depth (the deepest a node may be) is required when depths is a tensor")
    return depths, max_depth


def first_siblings(tokens: Tensor, parents: Tensor) -> Tensor:
    """bool ``[B, T]``: node i is the first child of its parent carrying its token (no earlier duplicate)."""
    T = tokens.shape[1]
    same = (parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
    earlier = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril(-1)  # [i, j]: j < i
    return ~(same & earlier).any(dim=-1)


def accept_tree(tokens: Tensor, parents: Tensor, tree_mask: Tensor, draws: Tensor, depths: Tensor | TreeSpec,
                max_depth: Optional[int] = None) -> Acceptance:
    """Follow the draws down the tree.

    Args:
        tokens, parents: int64 ``[B, T]`` the draft tree (root first, parents before children).
        tree_mask: bool ``[B, T, T]`` ancestor-or-self mask (:func:`~longspec.decode.tree.tree_mask_from_parents`).
        draws: int64 ``[B, T]`` the target's draw y at every node (:func:`node_draws`).
        depths, max_depth: as in :func:`node_draws` (D = the TreeSpec's depth or ``max_depth``).

    A node is accepted when every edge on its root path matches (the parent's draw is the node's token and the
    node is the first sibling with it). Accepted nodes form one path; its deepest node's draw is the bonus.
    """
    B, T = tokens.shape
    depth, D = _depths(depths, max_depth, tokens.device)
    depth = depth.expand(B, T)
    ok = (draws.gather(1, parents.clamp(min=0)) == tokens) & first_siblings(tokens, parents)
    ok[:, 0] = True  # the root is the pending token, already emitted
    accepted = ~(tree_mask & ~ok[:, None, :]).any(dim=-1)  # all ancestors-or-self ok
    deepest = torch.where(accepted, depth, -1).argmax(dim=1)  # [B]
    accept_len = depth.gather(1, deepest[:, None])[:, 0] + 1
    on_path = tree_mask.gather(1, deepest[:, None, None].expand(B, 1, T)).squeeze(1)  # [B, T]
    slot = torch.where(on_path, depth, D + 1)  # path node of depth d goes to column d; the rest to a dump column
    nodes = torch.arange(T, device=tokens.device).expand(B, T)
    accept_index = torch.zeros(B, D + 2, dtype=torch.int64, device=tokens.device).scatter_(1, slot, nodes)[:, : D + 1]
    emitted = torch.cat([tokens.gather(1, accept_index[:, 1:]), tokens.new_zeros(B, 1)], dim=1)
    bonus = draws.gather(1, deepest[:, None])
    emitted.scatter_(1, (accept_len - 1)[:, None], bonus)
    return Acceptance(accept_index, accept_len, emitted)
