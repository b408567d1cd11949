"""Prompt lookup decoding (PLD): draft the continuation of earlier occurrences of the last n tokens.

The context is the committed text plus the root. For every start position s of the context we look for the
longest n in ``[min_ngram, max_ngram]`` such that the n tokens before s equal the context's last n tokens;
candidates rank by (n, recency). A candidate's continuation is the text from s on, repeating the text from s to
the root once it reaches the root (a match that recent is a period of a repeating pattern). The best candidates'
continuations are merged into the tree as a trie: the best match is the chain along index 0 of every level, other
matches branch off where they differ (distinct siblings), and slots no match fills get a cheap guess (a repeat of
the level's first node). A chain (one node per depth, the best match alone) is one fused op,
``torch.ops.longspec.prompt_lookup_chain`` (two Triton launches on CUDA); a tree is batched tensor ops on the
context's device (``unfold`` for the matching, :mod:`longspec_ops.reference.lookup`), with loops over n-gram sizes
and depths only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from longspec_ops.reference import lookup

from .drafter import DecodeState, DraftTree, TreeSpec


class PromptLookupDrafter:
    """A :class:`~longspec.decode.drafter.Drafter` that copies continuations from the prompt and generated text.

    Args:
        max_ngram: longest suffix matched (preferred).
        min_ngram: shortest suffix matched.
    """

    reads_all_target_layers = False  # reads only token ids: works with KVUpdate.REFEED
    compilable = True  # propose traces as one torch.compile graph

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or min_ngram < 1:
            raise ValueError(f"min_ngram must be an int >= 1, got {min_ngram!r}")
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise ValueError(f"max_ngram must be an int >= min_ngram ({min_ngram}), got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def prefill(self, state: DecodeState, tree: TreeSpec) -> None:
        """Nothing to prepare: PLD reads ``state.tokens`` each round."""

    def observe(self, state: DecodeState, tree: TreeSpec) -> None:
        """Nothing to catch up on: PLD keeps no state between rounds."""

    def graph_state(self) -> list[Tensor]:
        """PLD keeps no state and ``propose`` makes no host sync, so the engine may capture it as a CUDA graph."""
        return []

    def propose(self, state: DecodeState, tree: TreeSpec) -> DraftTree:
        ctx = state.tokens  # [B, C]; tokens[b, seqlens[b]] is the root
        if max(tree.shape) == 1:  # a chain: the best candidate alone, one fused op
            return _chain(*torch.ops.longspec.prompt_lookup_chain(ctx, state.seqlens, tree.depth, self.min_ngram,
                                                                  self.max_ngram))
        last = state.seqlens.to(torch.int64)
        score = lookup.start_scores(ctx, last, self.min_ngram, self.max_ngram)
        k = min(max(tree.shape), score.shape[1])
        top, start = torch.topk(score, k, dim=1)  # [B, K] best continuation starts
        cont, valid = lookup.continuations(ctx, last, start, top >= 0, tree.depth)
        return _trie(state.root, cont, valid, tree)


def _trie(root: Tensor, cont: Tensor, valid: Tensor, tree: TreeSpec) -> DraftTree:
    """Merge candidate continuations ``[B, K, tree.depth]`` (best first) into a tree of ``tree.num_nodes`` nodes.

    A node's score is the log of the share of the found candidates that continue through it (0 when they all
    agree); fillers get -inf."""
    B, K, _ = cont.shape
    T = tree.num_nodes
    dev = cont.device
    tokens = torch.zeros(B, T + 1, dtype=torch.int64, device=dev)  # column T collects dropped writes
    parents = torch.zeros(B, T + 1, dtype=torch.int64, device=dev)
    scores = torch.full((B, T + 1), float("-inf"), device=dev)
    tokens[:, 0], parents[:, 0], scores[:, 0] = root, -1, 0.0
    node = torch.zeros(B, K, dtype=torch.int64, device=dev)  # each candidate's node at the current depth
    alive = valid[:, :, 0].clone()
    found = alive.sum(dim=1, keepdim=True).clamp(min=1)
    cand = torch.arange(K, device=dev)
    for d in range(1, tree.depth + 1):
        lo, width = tree.offsets[d], tree.shape[d - 1]
        live = alive & valid[:, :, d - 1]
        prefix = cont[:, :, :d]
        same = (prefix[:, :, None, :] == prefix[:, None, :, :]).all(dim=-1) & live[:, :, None] & live[:, None, :]
        rep = same.to(torch.int8).argmax(dim=-1)  # first candidate with the same prefix
        new = live & (rep == cand)
        rank = new.cumsum(dim=1) - 1
        kept = new & (rank < width)
        slot = torch.where(kept, lo + rank, T)
        tokens.scatter_(1, slot, cont[:, :, d - 1])
        parents.scatter_(1, slot, node)
        support = ((rep[:, :, None] == cand) & live[:, :, None]).sum(dim=1)  # [B, K]: candidates through each
        scores.scatter_(1, slot, torch.log(support / found))
        _fill_level(tokens, parents, kept.sum(dim=1), lo, width, tree.offsets[d - 1])
        node = torch.where(kept, lo + rank, -1).gather(1, rep)
        alive = live & (node >= 0)
    return DraftTree(tokens[:, :T], parents[:, :T], scores=scores[:, :T])


def _chain(chain: Tensor, found: Tensor) -> DraftTree:
    """:func:`_trie`'s tree for a chain spec from ``prompt_lookup_chain``'s chain ``[B, depth + 1]`` (the root first)
    and ``found`` ``[B]``: the same tokens, parents and scores (``tests/decode/test_pld.py`` checks them): score 0
    on a found row's nodes, -inf on the fillers (the root repeated) of a row without a match."""
    B, T = chain.shape
    scores = torch.where(found[:, None], 0.0, float("-inf")).expand(B, T).clone()
    scores[:, 0] = 0.0
    parents = torch.arange(-1, T - 1, device=chain.device).expand(B, -1)
    return DraftTree(chain, parents, scores=scores)


def _fill_level(tokens: Tensor, parents: Tensor, count: Tensor, lo: int, width: int, first_parent: int) -> None:
    """Slots ``[lo + count, lo + width)`` get the previous level's first node as parent and its token (a repeat)."""
    empty = torch.arange(width, device=tokens.device)[None, :] >= count[:, None]  # [B, width]
    guess = tokens[:, first_parent : first_parent + 1].expand_as(empty)
    tokens[:, lo : lo + width] = torch.where(empty, guess, tokens[:, lo : lo + width])
    parents[:, lo : lo + width] = torch.where(empty, first_parent, parents[:, lo : lo + width])
