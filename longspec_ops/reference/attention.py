"""Pure-PyTorch references for the ``longspec`` attention ops.

Each function here is at once the CPU kernel of its op, the test oracle for the GPU kernels and the
benchmark baseline. They favour clarity over speed except where a CPU user waits on them (a long prefill runs
through ``prefix_attn``), accumulate in float32 (float64 inputs stay float64) and follow flash-attn's layout:

    q        [B, M, Hq, D]      queries (M new tokens)
    k/v      [B, N, Hkv, D]     cache rows, rows [0, len) valid; or [B, K, Hkv, D] tree keys (mask [B, M, K])
    out      [B, M, Hq, D]      same dtype as q
    lse      [B, Hq, M]         float32, natural log; -inf where a query sees no key (out is then 0)

Query head h reads kv head h // (Hq // Hkv).
"""
from __future__ import annotations

import torch
from torch import Tensor


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# Mask-given attention goes in blocks of this many query rows, so the score tensor of a long query set stays
# bounded ([B, Hq, rows, N] at a time); every query row is independent, so blocking changes no result.
_QUERY_BLOCK = 1024

# Length-masked attention (prefix_attn, the prefix half of hybrid_tree_attn) goes in blocks of this many query rows,
# each over keys [0, longest length in the block) only: a causal prefill then computes about half the score matrix.
# Measured for one layer of a 4096-token causal prefill (6/2 heads, D 64, float32, 2 quiet CPU cores): 0.42 s with
# 128-row blocks, 0.45 s with 256, 0.52 s with 512, 0.59 s with 1024, and 3.3 s for the whole-mask formulation
# (``masked_attention``) it replaced.
_LENGTH_BLOCK = 256


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Masked attention in the accumulation dtype: out [B, M, Hq, D] and lse [B, Hq, M], neither rounded yet."""
    M = q.shape[1]
    if M <= _QUERY_BLOCK:
        return _attend_block(q, k, v, visible, scale)
    parts = [_attend_block(q[:, i:i + _QUERY_BLOCK], k, v, visible[:, i:i + _QUERY_BLOCK], scale)
             for i in range(0, M, _QUERY_BLOCK)]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)


def _attend_lengths(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q [B, M, Hq, D] where query i of row b sees rows [0, lens[b, i]) of k/v [B, N, Hkv, D].

    The same softmax as :func:`_attend`, without a [B, M, N] mask: query blocks of ``_LENGTH_BLOCK`` rows read only
    the keys below their longest length, and the scores are exponentiated in place. Rows at or past every length
    of a batch row are never read into ``out`` (their V is zeroed, so even NaN there cannot leak). Returns out
    [B, M, Hq, D] and lse [B, Hq, M] in the accumulation dtype; a query with length 0 gets out 0 and lse -inf.
    """
    B, M, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    acc = _acc_dtype(q)
    lens = lens.to(torch.int64)
    out = torch.zeros(B, M, Hq, D, dtype=acc, device=q.device)
    lse = torch.full((B, Hq, M), float("-inf"), dtype=acc, device=q.device)
    held = lens.amax(dim=1) if M else lens.new_zeros(B)  # [B] rows any query of the batch row reads
    for i in range(0, M, _LENGTH_BLOCK):
        lb = lens[:, i:i + _LENGTH_BLOCK]  # [B, Q]
        Q, n = lb.shape[1], int(lb.max())
        if n == 0:
            continue
        cols = torch.arange(n, device=q.device)
        kb = k[:, :n].to(acc).transpose(1, 2)  # [B, Hkv, n, D] views when k is already in acc
        vb = v[:, :n].to(acc)
        if int(held.min()) < n:  # some batch row holds fewer rows than this block reads
            vb = vb.masked_fill((cols[None, :] >= held[:, None])[:, :, None, None], 0.0)
        vb = vb.transpose(1, 2)
        qb = q[:, i:i + Q].to(acc).reshape(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
        s = torch.matmul(qb, kb.transpose(2, 3)).mul_(scale).view(B, Hkv, G, Q, n)
        s.masked_fill_((cols[None, None, :] >= lb[:, :, None])[:, None, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = m.masked_fill(torch.isinf(m), 0.0)  # a query that sees nothing: exp(-inf - 0) = 0, l = 0
        s.sub_(m).exp_()
        l = s.sum(dim=-1, keepdim=True)  # [B, Hkv, G, Q, 1]
        o = torch.matmul(s.view(B, Hkv, G * Q, n), vb).view(B, Hkv, G, Q, D)
        o = torch.where(l > 0, o / l, 0.0)
        out[:, i:i + Q] = o.permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D)
        lse[:, :, i:i + Q] = (m + torch.log(l)).reshape(B, Hq, Q)
    return out, lse


def _attend_block(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    B, M, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    acc = _acc_dtype(q)
    qf = q.to(acc).reshape(B, M, Hkv, G, D)
    # scores [B, Hkv, G, M, N]
    s = torch.einsum("bmhgd,bnhd->bhgmn", qf, k.to(acc)) * scale
    s = s.masked_fill(~visible[:, None, None, :, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf on empty rows
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse)[..., None], 0.0))
    p = p.masked_fill(~visible[:, None, None, :, :], 0.0)
    o = torch.einsum("bhgmn,bnhd->bmhgd", p, v.to(acc))
    return o.reshape(B, M, Hq, D), lse.reshape(B, Hq, M)


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The exact merge in the accumulation dtype (inputs already in it); -inf on either or both sides is safe."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).transpose(1, 2)[..., None]  # [B, M, H, 1]; exp(-inf) = 0 on an empty side
    wb = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    return out_a * wa + out_b * wb, lse


def masked_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q [B, M, Hq, D] over keys k/v [B, N, Hkv, D] where ``visible`` [B, M, N] (bool) is True.

    Returns out [B, M, Hq, D] (q's dtype) and lse [B, Hq, M] (float32). Rows with no visible key give
    out = 0 and lse = -inf.
    """
    out, lse = _attend(q, k, v, visible, scale)
    return out.to(q.dtype), lse.to(torch.float32)


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Exact softmax merge of two partial attentions over disjoint key sets.

    out_* [B, M, H, D], lse_* float32 [B, H, M]. lse = logaddexp(lse_a, lse_b); out is the lse-weighted sum.
    Either side may be -inf (empty); both -inf gives out 0 and lse -inf.
    """
    acc = _acc_dtype(out_a)
    out, lse = _merge(out_a.to(acc), lse_a.to(acc), out_b.to(acc), lse_b.to(acc))
    return out.to(out_a.dtype), lse.to(torch.float32)


def prefix_visibility(kv_lens: Tensor, M: int, N: int) -> Tensor:
    """visible [B, M, N]: query i sees rows [0, kv_lens[b]) or [0, kv_lens[b, i])."""
    lens = kv_lens.to(torch.int64)
    if lens.dim() == 1:
        lens = lens[:, None].expand(-1, M)
    cols = torch.arange(N, device=kv_lens.device)
    return cols[None, None, :] < lens[:, :, None]


def prefix_attn(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Non-causal attention of q [B, M, Hq, D] over cache rows [0, kv_lens) of k/v_cache [B, N, Hkv, D]."""
    lens = kv_lens if kv_lens.dim() == 2 else kv_lens[:, None].expand(-1, q.shape[1])
    out, lse = _attend_lengths(q, k_cache, v_cache, lens, scale)
    return out.to(q.dtype), lse.to(torch.float32)


def tree_attn(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of M tree queries over K tree keys: query i sees key j where tree_mask[b, i, j] (bool [B, M, K])."""
    return masked_attention(q, k, v, tree_mask, scale)


def hybrid_tree_attn(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    tree_mask: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One softmax over committed rows [0, cache_seqlens[b]) plus the tree keys each mask row allows.

    Computed as the GPU kernels do, prefix and tree parts merged by LSE, but both kept in the accumulation dtype
    until the end, so the merge rounds nothing (and the cache is never concatenated with the tree).
    """
    out_p, lse_p = _attend_lengths(q, k_cache, v_cache, cache_seqlens[:, None].expand(-1, q.shape[1]), scale)
    out_t, lse_t = _attend(q, k_tree, v_tree, tree_mask, scale)
    out, lse = _merge(out_p, lse_p, out_t, lse_t)
    return out.to(q.dtype), lse.to(torch.float32)


def draft_kv_lens(q_pos: Tensor, cache_seqlens: Tensor) -> Tensor:
    """Per-query visible target rows for the draft's cross-attention: [0, min(q_pos, cache_seqlens[b])).

    A re-fed token at position t sees target rows before t (delta = 1); a tree node sees the rows before
    the root, whose position is cache_seqlens[b].
    """
    return torch.minimum(q_pos.to(torch.int32), cache_seqlens.to(torch.int32)[:, None]).clamp_min(0)


def draft_cross_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, q_pos: Tensor, cache_seqlens: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """The draft's cross-attention into the target's cache; query i sees rows [0, min(q_pos[b, i], cache_seqlens[b]))."""
    return prefix_attn(q, k_cache, v_cache, draft_kv_lens(q_pos, cache_seqlens), scale)


def commit_kv_(kv_cache: Tensor, cache_seqlens: Tensor, accept_index: Tensor, accept_lens: Tensor) -> None:
    """Move accepted tree rows into place, in place, for every plane of ``kv_cache`` [P, B, N, Hkv, D].

    For each row b and j < accept_lens[b]: rows ``cache_seqlens[b] + j`` of every plane receive the rows
    ``cache_seqlens[b] + accept_index[b, j]`` as they were before the call (sources are read before any write).
    Like the CUDA kernel, lengths are clamped to A and a row whose source or destination lies outside [0, N) is
    skipped.

    No shape here depends on the values (no boolean indexing, no host read), so the reference is also the CUDA
    fallback of a build without ``longspec_ops._C`` inside a captured CUDA graph: every (b, j) writes one row, at
    its destination clamped into [0, N), and the value is the final one of that row (its accepted source, or the
    row itself), so rows written twice after clamping receive equal values.
    """
    P, B, N = kv_cache.shape[:3]
    A = accept_index.shape[1]
    if A == 0 or N == 0:
        return
    base = cache_seqlens.to(torch.int64)[:, None]  # [B, 1]
    j = torch.arange(A, device=kv_cache.device)[None, :]
    src = base + accept_index.to(torch.int64)  # [B, A]
    dst = base + j
    ok = (j < accept_lens.to(torch.int64)[:, None]) & (dst >= 0) & (dst < N) & (src >= 0) & (src < N)
    row = dst.clamp(0, N - 1)  # the row each (b, j) writes
    k = row - base  # the path entry whose destination that row is, if any
    k_ok = (k >= 0) & (k < A)
    k = k.clamp(0, A - 1)
    take = k_ok & ok.gather(1, k)
    source = torch.where(take, src.gather(1, k), row)
    b = torch.arange(B, device=kv_cache.device)[:, None].expand(B, A)
    kv_cache[:, b, row] = kv_cache[:, b, source].clone()  # gather first: sources may overlap destinations
