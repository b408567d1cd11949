"""Pure-PyTorch references for the invariant-numerics ops (the CPU kernels and the test oracles).

The GPU kernels of these ops (:mod:`longspec_ops.kernels.invariant`) reduce every output row in an order that does
not depend on how many rows a call holds, so a token's row is bitwise the same in a one-token decode forward and in
a tree verify forward. These references compute the same values (up to rounding order) for clarity; they make no
such promise themselves.

    x        [..., K]             linear input;   weight [N, K], bias [N] or None
    x        [..., H]             rms_norm input; weight [H]
    q        [B, M, Hq, D]        invariant_attn queries (after RoPE)
    k/v      [B, N, Hkv, D]       the cache: committed rows [0, cache_seqlens[b]), the new tokens' K/V after them
    ancestors int32 [B, M, A]     query m's depth-j ancestor sits at cache row cache_seqlens[b] + ancestors[b, m, j]
    depths   int32 [B, M]         query m's depth (its own row: j = depths[b, m])
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention import _attend, _attend_lengths, _merge


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` accumulated in float32 (float64 stays float64), rounded once to x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(acc) @ weight.to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, the statistics in
    float32; the output dtype is ``promote_types(x.dtype, weight.dtype)``."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def ancestor_rows(cache_seqlens: Tensor, ancestors: Tensor, depths: Tensor) -> tuple[Tensor, Tensor]:
    """int64 ``[B, M, A]`` cache rows of each query's ancestors (depth 0 .. A - 1) and bool ``[B, M, A]`` which of
    them it sees (depth <= its own)."""
    A = ancestors.shape[2]
    rows = cache_seqlens.to(torch.int64)[:, None, None] + ancestors.to(torch.int64)
    seen = torch.arange(A, device=depths.device)[None, None, :] <= depths.to(torch.int64)[:, :, None]
    return torch.where(seen, rows, 0), seen


def invariant_attn(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, ancestors: Tensor,
                   depths: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Query m of row b sees the committed rows ``[0, cache_seqlens[b])`` and its ancestors' rows
    ``cache_seqlens[b] + ancestors[b, m, j]``, ``j <= depths[b, m]``: exactly the keys plain decoding sees at that
    token once its ancestors are committed. Returns out ``[B, M, Hq, D]`` (q's dtype), lse float32 ``[B, Hq, M]``."""
    B, M, Hq, D = q.shape
    out_p, lse_p = _attend_lengths(q, k_cache, v_cache, cache_seqlens[:, None].expand(-1, M), scale)
    rows, seen = ancestor_rows(cache_seqlens, ancestors, depths)  # [B, M, A]
    A, Hkv = rows.shape[2], k_cache.shape[2]
    batch = torch.arange(B, device=q.device)[:, None, None]
    k_anc, v_anc = k_cache[batch, rows], v_cache[batch, rows]  # [B, M, A, Hkv, D]
    # Each query has its own keys: attend query by query as a batch of one-query problems.
    qm = q.reshape(B * M, 1, Hq, D)
    out_t, lse_t = _attend(qm, k_anc.reshape(B * M, A, Hkv, D), v_anc.reshape(B * M, A, Hkv, D),
                           seen.reshape(B * M, 1, A), scale)
    out_t = out_t.reshape(B, M, Hq, D)
    lse_t = lse_t.reshape(B, M, Hq).transpose(1, 2)
    out, lse = _merge(out_p, lse_p, out_t, lse_t)
    return out.to(q.dtype), lse.to(torch.float32)
