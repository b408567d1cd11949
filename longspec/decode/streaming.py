"""MagicDec-style self-speculation: the target drafts for itself over a sink + recent-window view of its cache.

Each round the drafter gathers, for every layer at once, the committed rows ``[0, sink) ∪ [L - window, L)`` of the
target's cache into its own compact :class:`~longspec.model.target.StaticKVCache` (left-aligned, keys keep the
RoPE of their true positions), then grows the draft tree level by level: the tree so far is run through the target
in the same TREE phase the verifier uses (``hybrid_tree_attn`` over the view's rows plus the tree block), and each
level keeps the global top-k (parent, token) pairs by cumulative log-probability. A chain is top-1 per level.

Why a compact view instead of masking the target's own cache: the op surface attends to row ranges that start at 0
(``prefix_attn``, ``hybrid_tree_attn``); ``[0, sink) ∪ [L - window, L)`` is not such a range when ragged rows put
L - window at different places. Gathering once per round reads the window once, while drafting reads it once per
level, and the draft tokens' K/V go to the view's own scratch rows, so the target's cache is never touched.
When ``L <= sink + window`` the view is the whole cache and the draft equals the target's own argmax tree.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from longspec.model.target import StaticKVCache, forward_tree, lm_logits

from .drafter import DecodeState, DraftTree, TreeSpec
from .tree import tree_mask_from_parents, tree_positions


class StreamingSelfDrafter:
    """A :class:`~longspec.decode.drafter.Drafter`: the target over a StreamingLLM view of its own cache.

    Args:
        sink: leading cache rows always visible (attention sinks).
        window: most recent committed rows visible.
    """

    reads_all_target_layers = True  # the view copies every layer's committed rows: needs KVUpdate.COMMIT

    def __init__(self, sink: int = 32, window: int = 1024) -> None:
        for name, value in (("sink", sink), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if sink + window < 1:
            raise ValueError("sink + window must be at least 1")
        self.sink = sink
        self.window = window
        self._view: Optional[StaticKVCache] = None  # the current batch size's
        self._views: dict[int, StaticKVCache] = {}  # batch size -> its view (graphs captured on it stay valid)

    def graph_state(self) -> list[Tensor]:
        """The view ``propose`` rewrites, so the engine can capture ``propose`` as a CUDA graph."""
        if self._view is None:
            raise RuntimeError("StreamingSelfDrafter.graph_state needs prefill() first")
        return [self._view.kv, self._view.seqlens]

    def nbytes(self) -> int:
        """Device bytes the drafter holds (its sink + window view of every layer); 0 before prefill."""
        return sum(v.kv.nbytes + v.seqlens.nbytes for v in self._views.values())

    def prefill(self, state: DecodeState, tree: TreeSpec) -> None:
        """Allocate the view: ``sink + window`` gathered rows plus one scratch row per tree node, every layer (one
        per batch size, kept while it fits, so captured graphs of ``propose`` stay valid across calls)."""
        L, _, B, _, H, D = state.cache.kv.shape
        rows = self.sink + self.window + tree.num_nodes
        view = self._views.get(B)
        if (view is None or view.kv.shape != (L, 2, B, rows, H, D) or view.kv.dtype != state.cache.kv.dtype
                or view.kv.device != state.cache.kv.device):
            view = self._views[B] = StaticKVCache(L, B, rows, H, D, state.cache.kv.dtype, state.cache.kv.device)
        self._view = view

    def propose(self, state: DecodeState, tree: TreeSpec) -> DraftTree:
        if self._view is None or self._view.batch_size != state.cache.batch_size:
            raise RuntimeError("StreamingSelfDrafter.propose called before prefill for this batch")
        self._gather_view(state.cache)
        B, T = state.root.shape[0], tree.num_nodes
        tokens = state.root[:, None].expand(B, T).clone()
        parents = torch.zeros(B, T, dtype=torch.int64, device=tokens.device)
        parents[:, 0] = -1
        cum = torch.zeros(B, 1, device=tokens.device)
        scores = torch.zeros(B, T, device=tokens.device)
        for d in range(1, tree.depth + 1):
            n, prev = tree.offsets[d], tree.offsets[d - 1]  # nodes decided so far; first node of depth d - 1
            logits = self._level_logits(state, tokens[:, :n], parents[:, :n], tree, prev)
            parent, token, cum = torch.ops.longspec.beam_topk(logits, cum, tree.shape[d - 1])
            tokens[:, n : tree.offsets[d + 1]] = token
            parents[:, n : tree.offsets[d + 1]] = prev + parent
            scores[:, n : tree.offsets[d + 1]] = cum
        return DraftTree(tokens, parents, scores=scores)

    def observe(self, state: DecodeState, tree: TreeSpec) -> None:
        """Nothing to catch up on: the view is gathered from the target's cache at every ``propose``."""

    def _gather_view(self, cache: StaticKVCache) -> None:
        """Copy rows ``[0, min(sink, L)) ++ [max(sink, L - window), L)`` of every layer into the view's front."""
        view = self._view
        L = cache.seqlens.to(torch.int64)[:, None]  # [B, 1]
        cap = self.sink + self.window
        j = torch.arange(cap, device=L.device)[None, :]
        head = L.clamp(max=self.sink)
        tail_start = torch.maximum(head, L - self.window)
        src = torch.where(j < head, j, tail_start + (j - head)).clamp(max=cache.max_len - 1)  # [B, cap]
        b = torch.arange(src.shape[0], device=L.device)[:, None].expand_as(src)
        view.kv[:, :, :, :cap] = cache.kv[:, :, b, src]
        view.seqlens.copy_((head + L - tail_start)[:, 0].to(torch.int32))

    def _level_logits(self, state: DecodeState, tokens: Tensor, parents: Tensor, tree: TreeSpec, first: int) -> Tensor:
        """Run the tree so far (``n`` nodes) over the view; ``[B, n - first, V]`` logits of the next token at nodes
        ``[first, n)`` (the deepest level: only its logits are needed)."""
        mask = tree_mask_from_parents(parents, tree)
        positions = tree_positions(state.seqlens, tree, tokens.shape[1])
        hidden = forward_tree(state.target, self._view, tokens, positions, mask)
        return lm_logits(state.target, hidden[:, first:])
