"""The round's tail, after the target forward: draws, acceptance, per-row stops and the state update.

Pure tensor functions with static shapes and no host sync, so the decoder can ``torch.compile`` them and capture
them in a CUDA graph (``commit_kv_`` runs between ``accept_tail`` and ``advance``, outside the compiled code: a
mutating custom op on the whole cache is no place for functionalisation).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .sampling import sample_tokens
from .verify import accept_tree, node_draws


def stop_lengths(
    emitted: Tensor, counts: Tensor, eos: Tensor, remaining: Tensor, active: Tensor
) -> tuple[Tensor, Tensor]:
    """Apply per-row stops to a round's emitted tokens.

    Args:
        emitted: int64 ``[B, A]`` tokens in order; counts: int64 ``[B]`` valid entries.
        eos: int64 ``[E]`` stop ids (may be empty); remaining: int64 ``[B]`` tokens still allowed per row.
        active: bool ``[B]`` rows still generating.

    Returns:
        ``(kept [B] int64, finished [B] bool)``: tokens kept (cut after the first EOS and at the budget; 0 for
        inactive rows) and the rows that stop this round.
    """
    A = emitted.shape[1]
    kept = torch.minimum(counts, remaining)
    col = torch.arange(A, device=emitted.device)[None, :]
    # a broadcast compare, not torch.isin: isin's sort-based path (more than a few stop ids, such as a slot's
    # padded buffer) synchronises, which a CUDA-graph capture cannot take
    is_eos = (emitted[:, :, None] == eos).any(dim=-1) & (col < kept[:, None])
    hit = is_eos.any(dim=1)
    kept = torch.where(hit, is_eos.to(torch.int8).argmax(dim=1) + 1, kept)
    kept = torch.where(active, kept, 0)
    finished = active & (hit | (kept >= remaining))
    return kept, finished


def accept_tail(logits, tokens, parents, mask, depths, params, max_depth, seqlens, eos, remaining, active, generator,
                seed):
    """After a verify: ``(emitted [B, D+1], kept [B], finished [B], accept_index [B, D+1], accept_len [B])`` from
    the tree's target logits ``[B, T, V]``, its nodes' depths ``[B, T]`` and D = ``max_depth`` (see
    :func:`~longspec.decode.verify.accept_tree`)."""
    draws = node_draws(logits, params, seqlens, depths, generator, seed, max_depth=max_depth)
    acc = accept_tree(tokens, parents, mask, draws, depths, max_depth=max_depth)
    kept, finished = stop_lengths(acc.emitted, acc.accept_len, eos, remaining, active)
    return acc.emitted, kept, finished, acc.accept_index, acc.accept_len


def plain_tail(logits, params, max_depth, seqlens, eos, remaining, active, generator, seed):
    """Plain decoding: one token per row drawn at position ``seqlens + 1``; no acceptance, no commit."""
    emitted = sample_tokens(logits, params, seqlens.to(torch.int64)[:, None] + 1, generator, seed=seed)
    kept, finished = stop_lengths(emitted, torch.ones_like(remaining), eos, remaining, active)
    return emitted, kept, finished, None, None


def advance(tokens: Tensor, root: Tensor, seqlens: Tensor, generated: Tensor, active: Tensor, emitted: Tensor,
            kept: Tensor, finished: Tensor) -> None:
    """Append each row's kept tokens after its root, make the last one the new root, and advance the lengths."""
    base = seqlens.to(torch.int64)[:, None] + 1
    tokens.scatter_(1, base + torch.arange(emitted.shape[1], device=base.device), emitted)
    new_root = emitted.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0]
    root.copy_(torch.where(kept > 0, new_root, root))
    seqlens.add_(kept.to(torch.int32))
    generated.add_(kept)
    active.logical_and_(~finished)


TAIL = {"accept": accept_tail, "plain": plain_tail, "advance": advance}
