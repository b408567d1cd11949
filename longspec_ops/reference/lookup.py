"""Pure-PyTorch reference of ``prompt_lookup_chain`` (the CPU kernel and the test oracle), and the matching it is
built from, which :class:`longspec.decode.pld.PromptLookupDrafter` also uses for its trie of several candidates.

    tokens  int64 [B, C]   each row's text: committed tokens, then the root at column seqlens[b]
    seqlens int   [B]      the root's column (the committed length)

A start s (the column a continuation begins at) matches with n tokens when the n tokens before s equal the n
tokens ending at the root, s <= the root's column (the n-gram ends before the root) and n in [min_ngram, max_ngram].
Starts rank by (longest n, most recent s): ``score = n * (C + 1) + s``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def start_scores(ctx: Tensor, last: Tensor, min_ngram: int, max_ngram: int) -> Tensor:
    """int64 ``[B, C + 1]``: for start s, ``n * (C + 1) + s`` for the longest matching n, else -1 (``last``: int64
    ``[B]``, the root's column)."""
    B, C = ctx.shape
    best = torch.full((B, C + 1), -1, dtype=torch.int64, device=ctx.device)
    for n in range(min_ngram, max_ngram + 1):
        if C < n + 1:
            break
        suffix_idx = (last[:, None] - n + 1 + torch.arange(n, device=ctx.device)).clamp(min=0)
        suffix = ctx.gather(1, suffix_idx)  # [B, n], the n-gram ending at the root
        windows = ctx.unfold(1, n, 1)  # [B, C - n + 1, n]
        i = torch.arange(C - n + 1, device=ctx.device)
        # the window must end before the root (so its continuation exists) and the suffix must exist
        ok = (i[None, :] <= last[:, None] - n) & (last[:, None] >= n - 1)
        match = (windows == suffix[:, None, :]).all(dim=-1) & ok
        score = torch.where(match, n * (C + 1) + i[None, :] + n, -1)  # start s = i + n
        best[:, n:] = torch.maximum(best[:, n:], score)
    return best


def continuations(ctx: Tensor, last: Tensor, start: Tensor, found: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """Tokens ``[B, K, depth]`` from each start ``[B, K]``, and their validity (``found``, expanded).

    A continuation that reaches the root goes on by repeating the text from its start to the root: the match ends
    where that text ends, so the text is a period of what was just written, and a repeating pattern (a list, a
    table, a loop in the output) is most likely to go on repeating. Without it a recent match's continuation would
    stop at the root (a period of 4 tokens would draft 4 at most, whatever the depth)."""
    B, C = ctx.shape
    K = start.shape[1]
    period = (last[:, None] + 1 - start).clamp(min=1)  # [B, K]; a found start lies in (0, last]
    idx = start[:, :, None] + torch.arange(depth, device=ctx.device) % period[:, :, None]  # [B, K, depth]
    valid = found[:, :, None].expand(B, K, depth)
    cont = ctx.gather(1, idx.clamp(max=C - 1).reshape(B, K * depth)).reshape(B, K, depth)
    return cont, valid


def prompt_lookup_chain(tokens: Tensor, seqlens: Tensor, depth: int, min_ngram: int,
                        max_ngram: int) -> tuple[Tensor, Tensor]:
    """The best match's chain: int64 ``[B, depth + 1]`` (the root, then the continuation; the root repeated where
    no start matches) and bool ``[B]`` whether a start matched."""
    last = seqlens.to(torch.int64)
    score = start_scores(tokens, last, min_ngram, max_ngram)
    top, start = score.max(dim=1, keepdim=True)  # the highest score: the longest n, then the latest start
    found = top[:, 0] >= 0
    cont, _ = continuations(tokens, last, start, found[:, None], depth)
    root = tokens.gather(1, last[:, None])
    return torch.cat([root, torch.where(found[:, None], cont[:, 0], root)], dim=1), found
