"""Pure-PyTorch reference of ``beam_topk``: one level of a beam tree, the global top-k (parent, token) pairs.

A beam-tree drafter (LongSpec's "global top-k over the flattened [parents x vocab] matrix") keeps, at each level,
the ``width`` pairs with the highest cumulative log-probability ``cum_logp[parent] + log_softmax(logits[parent])``.
This function is the op's CPU kernel and the oracle of its Triton kernel (:mod:`longspec_ops.kernels.beam`).

Ties go to the lower ``(parent, column)`` pair, in both stages and in the kernel: scores are compared through an
int64 key that puts the float's order in the high 32 bits and the reversed index in the low 32, so every key is
distinct and ``topk`` over keys is deterministic (``torch.topk`` on floats does not promise an order among ties).
"""
from __future__ import annotations

import torch
from torch import Tensor

_LOW = (1 << 32) - 1


def ordered_key(values: Tensor, index: Tensor) -> Tensor:
    """int64 keys ordered like ``values`` (float32), ties broken by the lower ``index`` (int64 in [0, 2^32)).

    The float's bits as int32 are monotone for non-negative floats; flipping the non-sign bits of negative ones
    makes them monotone everywhere (-0.0 sorts just below +0.0; NaN is not ordered)."""
    bits = values.to(torch.float32).view(torch.int32).to(torch.int64)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return order * (1 << 32) + (_LOW - index)


def _topk_lower_first(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of the top-k along the last dim, ties to the lower index."""
    index = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    idx = torch.topk(ordered_key(values, index), k, dim=-1).indices
    return values.gather(-1, idx), idx


def beam_topk(logits: Tensor, cum_logp: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The global top-``width`` (parent, column) pairs of one beam level, best first.

    Args:
        logits: float ``[B, P, V]`` the drafter's next-token logits at each of the P parents.
        cum_logp: float32 ``[B, P]`` the parents' cumulative log-probabilities.
        width: pairs to keep, ``1 <= width <= P * V``.

    Returns:
        ``parent`` int64 ``[B, width]`` in ``[0, P)``, ``column`` int64 ``[B, width]`` in ``[0, V)`` and ``score``
        float32 ``[B, width]`` = ``cum_logp[parent] + log_softmax(logits[parent])[column]``, by score descending
        (ties: lower parent, then lower column). Siblings are distinct columns by construction.
    """
    B, P, V = logits.shape
    logp = torch.log_softmax(logits.float(), dim=-1)
    # Two stages select the same set as one top-k over all P * V pairs: a pair in the global top-``width`` is in its
    # parent's own top-``width`` (the parent's cumulative log-probability shifts its whole row), and the second
    # stage's layout [parent, rank] orders equal scores as (parent, column) does.
    k = min(width, V)
    child, column = _topk_lower_first(logp, k)  # [B, P, k]
    cand = (cum_logp.float()[:, :, None] + child).reshape(B, P * k)
    score, idx = _topk_lower_first(cand, width)
    return idx // k, column.reshape(B, P * k).gather(1, idx), score
