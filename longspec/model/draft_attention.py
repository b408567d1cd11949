"""The draft's attention over whole sequences, differentiable (training and the dense tests; decoding runs the
``longspec_ops`` kernels in :class:`~longspec.decode.longspec_drafter.LongSpecDrafter`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, causal: bool = False) -> Tensor:
    """SDPA on flash-layout ``[B, S, H, D]`` tensors; kv heads are expanded to q's heads (GQA)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal)
    return out.transpose(1, 2)


def windowed_self_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, window: int) -> Tensor:
    """Causal attention where query i sees key j <= i iff ``positions[i] - positions[j] <= window``.

    q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``, positions int64 ``[B, S]`` non-decreasing. Queries go in blocks of
    C = window rows; since positions grow at least as fast as indices, block j only needs keys of blocks j-1 and j,
    so each block's mask is ``[C, 2C]`` and memory stays linear in S.
    """
    B, S, Hq, D = q.shape
    C = max(1, min(window, S))
    nb = -(-S // C)
    pad = nb * C - S

    def blocks(t: Tensor, fill) -> Tensor:  # [B, S, ...] -> [B, nb, C, ...] after padding the end
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad), value=fill).unflatten(1, (nb, C))

    def with_previous(t: Tensor) -> Tensor:  # [B, nb, C, ...] -> [B, nb, 2C, ...]: block j-1 then block j
        prev = torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1)
        return torch.cat([prev, t], dim=2)

    idx = blocks(torch.arange(S, device=q.device).expand(B, S), -1)
    pos = blocks(positions, 0)
    kidx, kpos = with_previous(idx), with_previous(pos)
    kidx[:, 0, :C] = -1  # no block before the first
    qi, ki = idx[:, :, :, None], kidx[:, :, None, :]
    mask = (ki >= 0) & (ki <= qi) & (pos[:, :, :, None] - kpos[:, :, None, :] <= window)
    mask |= (qi < 0) & (torch.arange(2 * C, device=q.device) == C + torch.arange(C, device=q.device)[:, None])
    qb, kb, vb = blocks(q, 0.0), with_previous(blocks(k, 0.0)), with_previous(blocks(v, 0.0))
    out = _sdpa(qb.flatten(0, 1), kb.flatten(0, 1), vb.flatten(0, 1), mask.flatten(0, 1)[:, None])
    return out.unflatten(0, (B, nb)).flatten(1, 2)[:, :S]


def shifted_cross_attention(q: Tensor, target_key: Tensor, target_value: Tensor, delta: int) -> Tensor:
    """Query t of q ``[B, S, Hq, D]`` attends to target rows ``<= t - delta`` of ``[B, N, Hkv, D]``.

    Flash noisy training's shift: queries from index delta on and the first S - delta target rows make a square
    causal problem, one flash-style call with no mask; the first delta queries see nothing and output 0.
    """
    B, S, Hq, D = q.shape
    if delta >= S:
        return torch.zeros_like(q)
    n = S - delta
    out = _sdpa(q[:, delta:], target_key[:, :n].to(q.dtype), target_value[:, :n].to(q.dtype), causal=True)
    return torch.cat([q.new_zeros(B, delta, Hq, D), out], dim=1)
