"""Typed public wrappers over ``torch.ops.longspec``: defaults, documentation, and value checks.

The raw ops check metadata everywhere and values (lengths within the cache) on CPU. On CUDA a value check needs a
host sync, so the raw ops leave it out (their kernels clamp) and these wrappers do it: call ``torch.ops.longspec.*``
directly in a hot loop, these functions where a clear error on a bad length is worth one sync (skipped under CUDA
graph capture and tracing).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _checks

_ops = torch.ops.longspec


def _check_lengths_on_cuda(op: str, name: str, lens: Tensor, limit: int) -> None:
    if isinstance(lens, Tensor) and lens.is_cuda:  # the CPU ops check values themselves
        _checks.check_lengths(op, name, lens, limit)


def _scale(q: Tensor, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Exact softmax merge of two partial attentions over disjoint key sets.

    Args:
        out_a, out_b: ``[B, M, H, D]`` partial outputs, one floating dtype.
        lse_a, lse_b: float32 ``[B, H, M]`` natural-log sums of exponentials; ``-inf`` marks an empty side.

    Returns:
        ``(out [B, M, H, D], lse float32 [B, H, M])`` with ``lse = logaddexp(lse_a, lse_b)``. Two empty sides give
        out 0 and lse -inf, never NaN.
    """
    return _ops.merge_attn_states(out_a, lse_a, out_b, lse_b)


def tree_attn(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, scale: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Masked attention among the M tree tokens (the paper's fused_mask_attn).

    Args:
        q: ``[B, M, Hq, D]``; k, v: ``[B, K, Hkv, D]`` with ``Hq % Hkv == 0`` (K = M for a whole tree; a level of
            a tree under construction may attend to more keys than it has queries).
        tree_mask: bool ``[B, M, K]``, True where query i may see key j (any boolean mask).
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(out [B, M, Hq, D], lse float32 [B, Hq, M])``.

    Example::

        >>> q = torch.randn(1, 5, 4, 64); k = v = torch.randn(1, 5, 2, 64)
        >>> mask = torch.ones(1, 5, 5, dtype=torch.bool).tril()
        >>> out, lse = tree_attn(q, k, v, mask)
    """
    return _ops.tree_attn(q, k, v, tree_mask, _scale(q, scale))


def prefix_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor, scale: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """Non-causal attention of M queries over cache rows ``[0, kv_lens)``.

    Args:
        q: ``[B, M, Hq, D]``; k_cache, v_cache: ``[B, N, Hkv, D]``.
        kv_lens: int32 ``[B]`` (every query sees rows ``[0, kv_lens[b])``) or ``[B, M]`` (per query).
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(out [B, M, Hq, D], lse float32 [B, Hq, M])``; a query that sees no row gets out 0, lse -inf.
    """
    _check_lengths_on_cuda("prefix_attn", "kv_lens", kv_lens, k_cache.shape[1])
    return _ops.prefix_attn(q, k_cache, v_cache, kv_lens, _scale(q, scale))


def hybrid_tree_attn(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    tree_mask: Tensor,
    scale: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """Exact attention of M tree queries over the committed cache plus the tree block under its mask.

    Equals one softmax over the union of rows ``[0, cache_seqlens[b])`` of the cache and the tree keys j with
    ``tree_mask[b, i, j]``.

    Args:
        q: ``[B, M, Hq, D]``; k_cache, v_cache: ``[B, N, Hkv, D]``; cache_seqlens: int32 ``[B]``.
        k_tree, v_tree: ``[B, K, Hkv, D]``; tree_mask: bool ``[B, M, K]`` (K = M for a whole tree).
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(out [B, M, Hq, D], lse float32 [B, Hq, M])``.

    Example::

        >>> B, N, M, Hq, Hkv, D = 1, 1024, 69, 32, 8, 128
        >>> q = torch.randn(B, M, Hq, D); kc = vc = torch.randn(B, N, Hkv, D)
        >>> kt = vt = torch.randn(B, M, Hkv, D); mask = torch.eye(M, dtype=torch.bool)[None]
        >>> out, lse = hybrid_tree_attn(q, kc, vc, torch.tensor([1000], dtype=torch.int32), kt, vt, mask)
    """
    _check_lengths_on_cuda("hybrid_tree_attn", "cache_seqlens", cache_seqlens, k_cache.shape[1])
    return _ops.hybrid_tree_attn(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, _scale(q, scale))


def draft_cross_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, cache_seqlens: Tensor, scale: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """The LongSpec draft's cross-attention into the target's (last-layer) KV cache.

    Query i, at absolute position ``q_pos[b, i]``, sees target rows ``[0, min(q_pos[b, i], cache_seqlens[b]))``:
    a re-fed token at position t sees the rows before t, a tree node sees the rows before the root (at
    ``cache_seqlens[b]``).

    Args:
        q: ``[B, M, Hq, D]`` (RoPE applied at q_pos); k_cache, v_cache: ``[B, N, Hkv, D]`` (keys post-RoPE).
        q_pos: int32 ``[B, M]``; cache_seqlens: int32 ``[B]``; scale: default ``1/sqrt(D)``.
    """
    _check_lengths_on_cuda("draft_cross_attn", "cache_seqlens", cache_seqlens, k_cache.shape[1])
    return _ops.draft_cross_attn(q, k_cache, v_cache, q_pos, cache_seqlens, _scale(q, scale))


def commit_kv_(kv_cache: Tensor, cache_seqlens: Tensor, accept_index: Tensor, accept_lens: Tensor) -> None:
    """Move the accepted tree rows into their committed slots, in place, for all layers in one call.

    Args:
        kv_cache: contiguous ``[P, B, N, Hkv, D]`` (P = 2 x layers: one allocation for every layer's K and V);
            the tree's K/V were written at rows ``cache_seqlens[b] + [0, M)``.
        cache_seqlens: int32 ``[B]`` committed lengths before this round (not updated here).
        accept_index: int32 ``[B, A]`` tree indices of the accepted path, in path order.
        accept_lens: int32 ``[B]`` number of valid entries of each accept_index row.

    Row ``cache_seqlens[b] + j`` of every plane receives row ``cache_seqlens[b] + accept_index[b, j]`` for
    ``j < accept_lens[b]``; all sources are read before any destination is written.
    """
    if kv_cache.is_cuda:
        _checks.check_commit(kv_cache, cache_seqlens, accept_index, accept_lens)
        _checks.check_commit_values(kv_cache, cache_seqlens, accept_index, accept_lens)
    _ops.commit_kv_(kv_cache, cache_seqlens, accept_index, accept_lens)


def invariant_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias`` whose every output row is independent of the other rows of the call.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` (x's dtype); bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in x's dtype, accumulated in float32. On CUDA one fixed tile configuration serves every M, and
        the split-K count (narrow outputs) depends on N, K and the device's SM count only, with the partials summed
        in a fixed order, so a row computed alone equals the same row inside a larger call bit for bit.
    """
    return _ops.invariant_linear(x, weight, bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """transformers' LlamaRMSNorm, one row at a time: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``.

    Args:
        x: ``[..., H]``; weight: ``[H]``; eps: added to the mean square.

    Returns:
        ``[..., H]`` in ``promote_types(x.dtype, weight.dtype)``; on CUDA each row's reduction is independent of the
        row count.
    """
    return _ops.rms_norm(x, weight, float(eps))


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, norm_weight: Optional[Tensor] = None,
                 eps: float = 1e-6, residual: Optional[Tensor] = None, swiglu: bool = False,
                 weight_scale: Optional[Tensor] = None) -> Tensor:
    """``[residual +] act(linear(norm(x)))``: a draft level's linear with its neighbours folded in.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` (x's dtype, or float8_e4m3fn with ``weight_scale``); bias: ``[N]`` or
            None.
        weight_scale: float32 ``[N]``: weight is float8 and row n stands for ``weight[n] * weight_scale[n]``
            (:func:`quantize_fp8_rows` makes both); the product accumulates in float32 and is rounded once.
        norm_weight: ``[K]``: RMS-normalise x first (transformers' LlamaRMSNorm, ``eps`` on the mean square).
        swiglu: weight is the packed ``[gate; up]`` projection (N = 2 I): the result is ``silu(gate) * up``, I wide.
        residual: ``[..., N]`` (``[..., I]`` with swiglu) added last.

    Returns:
        ``[..., N]`` (or ``[..., I]``) in x's dtype. On CUDA up to 16 rows run one Triton launch that reads each
        weight row once for all rows (:mod:`longspec_ops.kernels.linear`); more rows, and the CPU, run the
        composition of PyTorch ops (on CUDA with ``rms_norm``'s kernel).
    """
    return _ops.fused_linear(x, weight, bias, norm_weight, float(eps), residual, bool(swiglu), weight_scale)


def invariant_attn(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    ancestors: Tensor,
    depths: Tensor,
    scale: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """Attention of M queries (tree nodes, or one decode token) over exactly the keys plain decoding would see.

    Query m of row b sees the committed rows ``[0, cache_seqlens[b])`` and then, at positions
    ``cache_seqlens[b] + j`` for ``j <= depths[b, m]``, cache row ``cache_seqlens[b] + ancestors[b, m, j]`` (its
    depth-j ancestor's K/V, written there by this forward; j = depths[b, m] is the query itself). On CUDA the keys
    are reduced in splits at fixed absolute positions, so the result for a query equals bit for bit a one-token
    call (``ancestors = depths = 0``) after its ancestors are committed.

    Args:
        q: ``[B, M, Hq, D]``; k_cache, v_cache: ``[B, N, Hkv, D]``; cache_seqlens: int32 ``[B]``.
        ancestors: int32 ``[B, M, A]`` (A > max depth); depths: int32 ``[B, M]``.
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(out [B, M, Hq, D], lse float32 [B, Hq, M])``.

    Example::

        >>> q = torch.randn(1, 1, 4, 64); kc = vc = torch.randn(1, 128, 2, 64)
        >>> zero = torch.zeros(1, 1, 1, dtype=torch.int32)
        >>> out, lse = invariant_attn(q, kc, vc, torch.tensor([100], dtype=torch.int32), zero, zero[..., 0])
    """
    if isinstance(k_cache, Tensor) and k_cache.is_cuda:
        _checks.check_invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, _scale(q, scale))
        _checks.check_invariant_attn_values(k_cache, cache_seqlens, ancestors, depths)
    return _ops.invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, _scale(q, scale))


def prompt_lookup_chain(tokens: Tensor, seqlens: Tensor, depth: int, min_ngram: int = 1,
                        max_ngram: int = 3) -> tuple[Tensor, Tensor]:
    """Prompt lookup's best chain per row: the continuation of the latest of the longest n-grams (n in
    ``[min_ngram, max_ngram]``) that end at the root and occur earlier in the row.

    Args:
        tokens: int64 ``[B, C]``, each row's text with the root at column ``seqlens[b]`` (columns after it unread).
        seqlens: int32 or int64 ``[B]``, the root's column (the committed length).
        depth: drafts per chain (>= 1).

    Returns:
        ``chain`` int64 ``[B, depth + 1]``: the root, then the tokens that followed the match; where they reach the
        root they repeat the text from the match to the root (a period of a repeating pattern); a row without a
        match repeats its root. ``found`` bool ``[B]``: whether the row matched. On CUDA two Triton launches
        (:mod:`longspec_ops.kernels.lookup`).
    """
    _checks.check_lookup(tokens, seqlens, depth, min_ngram, max_ngram)
    if tokens.is_cuda:  # the CPU op checks values itself
        _checks.check_lookup_values(tokens, seqlens)
    return _ops.prompt_lookup_chain(tokens, seqlens, int(depth), int(min_ngram), int(max_ngram))


def beam_topk(logits: Tensor, cum_logp: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """One beam-tree level: the global top-``width`` (parent, column) pairs by cumulative log-probability.

    Args:
        logits: float ``[B, P, V]``, the drafter's next-token logits at each of P parents (any float dtype: read
            once in it, scored in float32).
        cum_logp: float32 ``[B, P]``, the parents' cumulative log-probabilities.
        width: pairs to keep, ``1 <= width <= P * V``.

    Returns:
        ``parent`` int64 ``[B, width]``, ``column`` int64 ``[B, width]`` and ``score`` float32 ``[B, width]`` =
        ``cum_logp[parent] + log_softmax(logits[parent])[column]``, best first; ties go to the lower parent, then the
        lower column. On CUDA two Triton launches (:mod:`longspec_ops.kernels.beam`).

    Example::

        >>> logits = torch.randn(1, 4, 32000)                     # 4 parents
        >>> parent, column, score = longspec_ops.beam_topk(logits, torch.zeros(1, 4), 16)
    """
    _checks.check_beam(logits, cum_logp, width)
    return _ops.beam_topk(logits, cum_logp, int(width))
