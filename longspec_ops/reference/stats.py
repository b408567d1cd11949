"""Pure-PyTorch reference of ``record_acceptance_`` (the CPU kernel and the test oracle): one verified round
counted into an adaptive budget's acceptance statistics (:class:`longspec.decode.budget.AcceptanceStats`).

    proposed, accepted float32 [cells]   decayed counts of verified and accepted nodes by statistics cell
    realised           float32 [K]       every option's running realised tau
    mass               float32 [K]       the weight of the rounds behind each running mean
    seen               bool    [K]       whether an option has a running mean
    keys               int64   [B, T]    the verified nodes' cells
    within             float32 [B, T, K] 1 where verified node t is one of option k's kept nodes
    contained          bool    [K]       option k's kept nodes all lie in the verified tree
    accept_index       int64   [B, A]    the accepted path's nodes, root first, valid up to accept_len
    accept_len         int64   [B]
    active             bool    [B]
"""
from __future__ import annotations

import torch
from torch import Tensor


def record_acceptance_(proposed: Tensor, accepted: Tensor, realised: Tensor, mass: Tensor, seen: Tensor,
                       keys: Tensor, within: Tensor, contained: Tensor, accept_index: Tensor, accept_len: Tensor,
                       active: Tensor, decay: float, rate: float) -> None:
    """Age the counts by ``decay`` and count the round: every non-root node of an active row as proposed, the
    accepted path's as accepted. Every contained option's realised tau (1 + the accepted path's nodes among its
    kept ones, averaged over the active rows) enters its running mean: every verified round ages every mean's
    weight by ``1 - rate`` and a scored option adds its round at weight ``rate``. A round on finished rows only
    scores nothing and ages nothing (the counts still decay)."""
    B, T = keys.shape
    col = torch.arange(accept_index.shape[1], device=keys.device)
    path = torch.where(col[None, :] < accept_len[:, None], accept_index, T)
    on_path = torch.zeros(B, T + 1, device=keys.device).scatter_(1, path, 1.0)[:, :T]
    weight = active[:, None].float().expand(B, T).clone()
    weight[:, 0] = 0.0  # the root is the pending token, not a draft
    proposed.mul_(decay).index_add_(0, keys.reshape(-1), weight.reshape(-1))
    accepted.mul_(decay).index_add_(0, keys.reshape(-1), (weight * on_path).reshape(-1))
    rows = active.float() / active.float().sum().clamp(min=1.0)
    tau = torch.einsum("bt,btk,b->k", on_path, within, rows)  # the root counts: it is every option's
    update = contained & active.any()
    mass.mul_(torch.where(active.any(), 1.0 - rate, 1.0))
    w = rate * update
    realised.lerp_(tau, w / (mass + w).clamp(min=1e-12))
    mass.add_(w)
    seen.logical_or_(update)
