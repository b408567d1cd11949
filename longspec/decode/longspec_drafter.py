"""LongSpecDrafter: beam-tree drafting with a :class:`~longspec.model.draft.LongSpecDraft` in constant memory.

**Window (exact definition).** A draft query at position t attends to the self-attention keys *on its own path*
at positions ``t - W .. t`` (W = ``config.window``, 512 for the published drafts): W + 1 keys with itself once the
context is long enough. This is flash-attn's ``window_size=(W, -1)`` applied along the path, which is what training
saw. A depth-d tree node (position ``root + d``) thus sees the committed tokens at ``root + d - W .. root`` (root
included) plus its ancestors and itself; the left edge depends on the node's depth, never on its index in a level.

**Caches** (:class:`LongSpecDraftCache`), sized by batch, window and tree only, never by the context:

* ``ring_k/ring_v [B, W+1, Hkv, D]``: post-RoPE self-attention K/V of the most recent committed tokens, position p
  in slot ``p % (W+1)``. W + 1 slots are exactly what the root (whose window reaches back W) needs; older slots
  are overwritten as the context grows. The keys carry RoPE, so no slot needs its position again.
* ``win_k/win_v [B, W+1, Hkv, D]``: the ring re-read newest first (row j = position ``root - j``), once per round.
  The attention ops see rows ``[0, len)`` of a cache, and in this order every query's window is such a prefix:
  ``min(W + 1 - d, root + 1)`` rows at depth d. (A ring read in place would need a cyclic range per row.)
* ``tree_k/tree_v [B, T-1, Hkv, D]``: the non-root nodes' K/V in level order; ``mask [B, T, T]``: the whole tree's
  ancestor-or-self mask, grown level by level. Its non-root block is the draft's tree attention mask, and the whole
  of it goes to the engine with the tree (the verify forward's mask), so the tree structure is built once per round.

**A round** (:meth:`LongSpecDrafter.propose`): (1) re-feed: the K/V of the tokens committed since the last call and
of the new root go into the ring (a fixed ``min(max_depth + 1, W + 1)`` positions ending at the root, masked to those
already in the ring: the protocol commits at most ``max_depth + 1`` tokens between two calls, and a round that
leaves this drafter out calls :meth:`~LongSpecDrafter.observe`, which re-feeds the same way); only the root also
needs a query, since a single block's K/V depend on nothing but (token, position). (2) The ring is read into the window.
(3) Level 0 runs the root, levels 1..depth-1 run all nodes of the previous depth: self-attention = one
``hybrid_tree_attn`` launch over the window (the committed part) and the nodes drafted so far under the level's
ancestor rows (the root alone: ``prefix_attn`` over the window); cross-attention = ``prefix_attn`` over the target's
committed rows, which every node sees (the rows before the root). Each level keeps the global top-k (parent, token)
pairs by cumulative log-probability, read off the logits by ``beam_topk`` (two launches). Leaves are never run.
With a reduced drafting vocabulary (:meth:`~longspec.model.draft.LongSpecDraft.set_draft_vocab`) each level scores
only those rows of the LM head, and the chosen columns map back to target ids.
Everything is batched over rows with ragged lengths; there is no host synchronisation in the drafter itself.

**Tensor-parallel targets.** The draft is replicated on every rank; the target's cache holds only the rank's KV
heads, so the cross-attention runs the matching query heads there and the ranks all-gather the outputs
(:meth:`~longspec.model.draft.LongSpecDraft.finish`): ``[B, M, Hq, D]`` per drafted level, never a cache row.
Every rank then computes the same tree from the same values, so nothing else is exchanged. The other choice,
drafting on one rank and broadcasting the tree (one collective per round instead of one per level), needs the whole
last layer's cache on that rank: a second copy of it (``N x Hkv x D``, kept current by gathering every round's
committed rows), with the other ranks idle while it drafts. Which is faster on GPUs is not measured yet.

**Prefill** computes only what the ring needs: the self-attention K/V of each row's last W prompt tokens (a fixed
``[B, W]`` projection), with no attention, cross-attention or MLP over the prompt.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)
from longspec.model.draft import LongSpecDraft, check_target_compatible
from longspec.model.packing import check_weight_dtype

from .drafter import DecodeState, DraftTree, TreeSpec


@dataclass
class LongSpecDraftCache:
    """The drafter's state between calls; every tensor's size is independent of the context length.

    ring_k, ring_v: ``[B, W+1, Hkv, D]`` committed K/V (post-RoPE), position p in slot ``p % (W+1)``.
    ring_end:       int64 ``[B]`` one past the last position written to the ring.
    win_k, win_v:   ``[B, W+1, Hkv, D]`` this round's window, newest first (row j = position ``root - j``).
    tree_k, tree_v: ``[B, T-1, Hkv, D]`` K/V of the non-root nodes (node i in row i - 1).
    mask:           bool ``[B, T, T]`` node j is node i or one of its ancestors (the root row and column are fixed).
    """

    ring_k: Tensor
    ring_v: Tensor
    ring_end: Tensor
    win_k: Tensor
    win_v: Tensor
    tree_k: Tensor
    tree_v: Tensor
    mask: Tensor

    @classmethod
    def allocate(cls, draft: LongSpecDraft, batch: int, tree: TreeSpec, device: torch.device) -> "LongSpecDraftCache":
        c = draft.config
        W1, T1, Hkv, D = c.window + 1, tree.num_nodes - 1, c.num_key_value_heads, c.head_dim
        # Zeros, not empty: masked-out rows still enter the reference kernels as 0 * value, and garbage could be NaN.
        kv = dict(dtype=draft.dtype, device=device)
        return cls(
            ring_k=torch.zeros(batch, W1, Hkv, D, **kv),
            ring_v=torch.zeros(batch, W1, Hkv, D, **kv),
            ring_end=torch.zeros(batch, dtype=torch.int64, device=device),
            win_k=torch.zeros(batch, W1, Hkv, D, **kv),
            win_v=torch.zeros(batch, W1, Hkv, D, **kv),
            tree_k=torch.zeros(batch, T1, Hkv, D, **kv),
            tree_v=torch.zeros(batch, T1, Hkv, D, **kv),
            mask=_root_mask(batch, T1 + 1, device),
        )

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (the drafter's whole persistent device footprint)."""
        return sum(getattr(self, f.name).nbytes for f in fields(self))


def _root_mask(batch: int, T: int, device: torch.device) -> Tensor:
    """The mask's fixed part: every node sees the root (column 0); the root sees only itself. Other rows are
    written level by level."""
    mask = torch.zeros(batch, T, T, dtype=torch.bool, device=device)
    mask[:, :, 0] = True
    return mask


class LongSpecDrafter:
    """The :class:`~longspec.decode.drafter.Drafter` for a :class:`LongSpecDraft` (see the module docstring).

    Example::

        >>> draft = LongSpecDraft.from_pretrained("sail/longspec-Llama-3-8B-Instruct-262k", target=target)
        >>> decoder = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(4, 16, 16, 16, 16))
    """

    # Reads only the target's last layer (cross-attention) and token ids, so KVUpdate.REFEED, which compacts only
    # that layer after a verify, serves it as well as COMMIT.
    reads_all_target_layers = False
    compilable = True  # propose traces as one torch.compile graph

    def __init__(self, draft: LongSpecDraft, weight_dtype: Optional[torch.dtype] = None) -> None:
        """``weight_dtype=torch.float8_e4m3fn`` drafts with float8 copies of the draft's linears and drafting head
        rows (per-row scales; :meth:`~longspec.model.draft.LongSpecDraft.pack_for_drafting`): half the bytes of a
        draft level at real sizes; the trees change slightly, the output does not."""
        check_weight_dtype(weight_dtype, draft.dtype, "LongSpecDrafter")
        self.draft = draft
        self.weight_dtype = weight_dtype
        self.cache: Optional[LongSpecDraftCache] = None  # the current batch size's
        self._caches: dict[int, LongSpecDraftCache] = {}  # batch size -> its cache (graphs captured on it stay valid)
        self._tree: Optional[TreeSpec] = None  # the tree the caches were allocated for

    @property
    def vocab_size(self) -> int:
        """The vocabulary drafted from (the target's LM head rows); the engine checks it against the target."""
        return self.draft.vocab_size

    def nbytes(self) -> int:
        """Device bytes the drafter holds (its caches, one per batch size; independent of the context length); 0
        before prefill."""
        return sum(c.nbytes() for c in self._caches.values())

    def graph_state(self) -> list[Tensor]:
        """Every tensor ``propose`` mutates (the cache), so the engine can capture ``propose`` as a CUDA graph."""
        if self.cache is None:
            raise RuntimeError("LongSpecDrafter.graph_state needs prefill() first")
        return [getattr(self.cache, f.name) for f in fields(self.cache)]

    # --- protocol ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, state: DecodeState, tree: TreeSpec) -> None:
        """Check the target, pick this batch size's cache (allocated once per batch size and tree, so captured
        graphs of ``propose`` stay valid across calls) and fill the ring with each row's last W prompt tokens'
        K/V."""
        self._check(state, tree)
        self.draft.pack_for_drafting(self.weight_dtype)  # eager, before any capture: one GEMM for q/k/v, one for
        # gate/up (and the float8 copies, when asked for)
        B = state.tokens.shape[0]
        if self._tree != tree:
            self._caches, self._tree = {}, tree
        cache = self._caches.get(B)
        if cache is None or cache.ring_k.device != state.tokens.device or cache.ring_k.dtype != self.draft.dtype:
            cache = self._caches[B] = LongSpecDraftCache.allocate(self.draft, B, tree, state.tokens.device)
        self.cache = cache
        W = self.draft.config.window
        P = state.seqlens.to(torch.int64)
        if W > 0:
            pos = P[:, None] - W + torch.arange(W, device=P.device)  # [B, W]: the last W prompt positions
            ids = state.tokens.gather(1, pos.clamp(0, state.tokens.shape[1] - 1))
            self._write_ring(pos, ids, pos >= 0)
        self.cache.ring_end.copy_(P)

    @torch.no_grad()
    def propose(self, state: DecodeState, tree: TreeSpec) -> DraftTree:
        """Draft a ``tree.num_nodes``-node beam tree per row rooted at ``state.root`` (see the module docstring).

        Requires ``prefill`` for this batch with ``tree`` or a tree it is a depth-truncated prefix of, and (the
        protocol's guarantee) at most ``state.max_depth + 1`` tokens committed since the previous call. The tree's
        scores are the nodes' cumulative log-probabilities under the draft.
        """
        self._check_round(state, tree)
        cos_all, sin_all = self._refeed(state, tree, tree.depth)  # [B, depth, D]: RoPE at the levels' positions
        self._read_window(state.seqlens.to(torch.int64))
        tokens, parents = [state.root[:, None]], [torch.full_like(state.root[:, None], -1)]
        level, cum = state.root[:, None], torch.zeros(state.root.shape[0], 1, device=state.root.device)
        scores = [cum]
        for d in range(tree.depth):  # level d's nodes propose depth d + 1; the leaves (depth `tree.depth`) never run
            logits = self._level_logits(state, tree, level, d, cos_all[:, d:d + 1], sin_all[:, d:d + 1])
            parent, column, cum = torch.ops.longspec.beam_topk(logits, cum, tree.shape[d])
            level = self.draft.target_token_ids(column)
            parent = parent + tree.offsets[d]
            self._extend_mask(tree, d + 1, parent)
            tokens.append(level)
            parents.append(parent)
            scores.append(cum)
        T = tree.num_nodes
        return DraftTree(tokens=torch.cat(tokens, 1), parents=torch.cat(parents, 1),
                         mask=self.cache.mask[:, :T, :T], scores=torch.cat(scores, 1))

    @torch.no_grad()
    def observe(self, state: DecodeState, tree: TreeSpec) -> None:
        """A round that verifies no tree of this drafter: the K/V of the tokens committed since the last call and of
        the root go into the ring, as ``propose`` writes them first (``tree`` only bounds the depth when
        ``state.max_depth`` is None; a merged drafter passes its own tree here)."""
        if self.cache is None or self.cache.ring_k.shape[0] != state.tokens.shape[0]:
            raise RuntimeError("LongSpecDrafter.observe needs prefill() for this batch first")
        self._refeed(state, tree)

    def _check_round(self, state: DecodeState, tree: TreeSpec) -> None:
        if self.cache is None or self.cache.ring_k.shape[0] != state.tokens.shape[0]:
            raise RuntimeError("LongSpecDrafter.propose needs prefill() for this batch first")
        if tree.shape != self._tree.shape[: tree.depth]:
            raise ValueError(f"tree {tree.shape} is not the tree given to prefill ({self._tree.shape}) or a "
                             f"depth-truncated prefix of it")

    # --- rounds -----------------------------------------------------------------------------------------------------

    def _refeed(self, state: DecodeState, tree: TreeSpec, levels: int = 0) -> tuple[Tensor, Tensor]:
        """Write the K/V of positions ``[ring_end, root]`` into the ring: tokens committed since the last call + root.
        Returns RoPE's cos, sin ``[B, levels, D]`` at positions ``root .. root + levels - 1`` (the draft levels'),
        from the same call of the rotary module as the re-feed's (one float32 GEMM and two elementwise kernels a
        call: the positions run on from the re-feed's).

        A fixed ``F = min(max_depth + 1, W + 1)`` positions ending at the root, those before ``ring_end`` masked:
        between two calls (``propose`` or ``observe``) a round commits at most ``max_depth + 1`` tokens, so
        ``ring_end >= root - max_depth``, and positions more than W back are never read again. (It was W + 1
        positions, so that rounds leaving the drafter out could skip it: at the published window a [B, 513] K/V
        projection, RoPE and ring write per call; the projection alone took 18.6 us of a Llama-3-8B draft step in
        ``benchmarks/results/h200/draft_profile.txt``.)
        """
        cache, W = self.cache, self.draft.config.window
        r = state.seqlens.to(torch.int64)
        F = min((state.max_depth if state.max_depth is not None else tree.depth) + 1, W + 1)
        every = r[:, None] - (F - 1) + torch.arange(F + max(levels - 1, 0), device=r.device)  # root at column F - 1
        pos = every[:, :F]  # [B, F], the root last
        committed = state.tokens.gather(1, pos.clamp(0, state.tokens.shape[1] - 1))
        ids = torch.where(pos == r[:, None], state.root[:, None], committed)
        cos, sin = self.draft.rope(cache.ring_k, every.clamp_min(0))
        self._write_ring(pos, ids, (pos >= cache.ring_end[:, None]) & (pos >= 0), (cos[:, :F], sin[:, :F]))
        cache.ring_end.copy_(r + 1)
        return cos[:, F - 1:F - 1 + levels], sin[:, F - 1:F - 1 + levels]

    def _write_ring(self, pos: Tensor, ids: Tensor, valid: Tensor, rope: Optional[tuple[Tensor, Tensor]] = None
                    ) -> None:
        """K/V of ``ids`` at positions ``pos`` (int64 ``[B, S]``, distinct slots per row) into the ring where valid;
        ``rope``: RoPE's (cos, sin) at ``pos`` when the caller has them."""
        cache, draft = self.cache, self.draft
        x = draft.embed(ids)
        cos, sin = rope if rope is not None else draft.rope(x, pos.clamp_min(0))
        _, k, v = draft.self_qkv(x, cos, sin, need_q=False)
        slot = pos.remainder(cache.ring_k.shape[1])
        b = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(slot)
        keep = valid[:, :, None, None]
        cache.ring_k[b, slot] = torch.where(keep, k, cache.ring_k[b, slot])
        cache.ring_v[b, slot] = torch.where(keep, v, cache.ring_v[b, slot])

    def _read_window(self, root_pos: Tensor) -> None:
        """win[:, j] = ring[:, (root - j) % (W+1)]: the ring newest first, so each window is a prefix of rows."""
        cache = self.cache
        W1 = cache.ring_k.shape[1]
        slot = (root_pos[:, None] - torch.arange(W1, device=root_pos.device)).remainder(W1)
        idx = slot[:, :, None, None].expand_as(cache.win_k)
        cache.win_k.copy_(torch.gather(cache.ring_k, 1, idx))  # not gather(out=): torch.compile's fake-tensor
        cache.win_v.copy_(torch.gather(cache.ring_v, 1, idx))  # check of out= fails on a dynamic batch

    def _level_logits(self, state: DecodeState, tree: TreeSpec, level: Tensor, d: int, cos: Tensor,
                      sin: Tensor) -> Tensor:
        """Run the draft on level d's nodes (int64 ``[B, M]``, position root + d, where ``cos``/``sin`` ``[B, 1, D]``
        are RoPE): logits ``[B, M, V']`` over the drafting vocabulary."""
        draft, cache = self.draft, self.cache
        r = state.seqlens.to(torch.int64)
        x = draft.embed(level)
        cos, sin = cos.expand(-1, level.shape[1], -1), sin.expand(-1, level.shape[1], -1)
        q, k, v = draft.self_qkv(x, cos, sin)
        # The committed part of the window: positions root + d - W .. root, capped by what exists.
        lens = torch.clamp(r + 1, max=draft.config.window + 1 - d).clamp_min(0).to(torch.int32)
        scale = draft.config.head_dim ** -0.5
        if d == 0:
            self_out, _ = torch.ops.longspec.prefix_attn(q, cache.win_k, cache.win_v, lens, scale)
        else:
            lo, hi = tree.offsets[d] - 1, tree.offsets[d + 1] - 1  # this level's rows in the node scratch
            cache.tree_k[:, lo:hi], cache.tree_v[:, lo:hi] = k, v
            # One launch: the window, then the nodes drafted so far (this level's included) under its ancestor rows.
            self_out, _ = torch.ops.longspec.hybrid_tree_attn(q, cache.win_k, cache.win_v, lens, cache.tree_k[:, :hi],
                                                              cache.tree_v[:, :hi], self._ancestors(tree, d, lo, hi),
                                                              scale)
        L = state.target.config.get_text_config().num_hidden_layers
        # Every node of the round sees the target's committed rows, those before the root: q_pos = None.
        out = draft.finish(x, self_out, cos, sin, state.cache.key(L - 1), state.cache.value(L - 1), None,
                           state.seqlens.to(torch.int32), tp=state.cache.tp)
        return draft.draft_logits(out)

    def _extend_mask(self, tree: TreeSpec, d: int, parent: Tensor) -> None:
        """Mask rows of the depth-d nodes: their parent's row plus themselves.

        parent: int64 ``[B, M]`` node indices (depth d - 1), M = ``tree.shape[d - 1]``.
        """
        mask = self.cache.mask
        B, M = parent.shape
        T = mask.shape[1]
        lo = tree.offsets[d]
        rows = torch.gather(mask, 1, parent[:, :, None].expand(B, M, T))
        j = torch.arange(M, device=parent.device)
        rows[:, j, lo + j] = rows.new_ones(())  # a device scalar: a host one would be a copy inside a graph capture
        mask[:, lo : lo + M] = rows

    def _ancestors(self, tree: TreeSpec, d: int, lo: int, hi: int) -> Tensor:
        """bool ``[B, hi - lo, hi]``: the ancestor-or-self rows of level d's nodes (non-root rows ``[lo, hi)``) over
        the first ``hi`` non-root nodes. With W < d, ancestors more than W levels up fall out of the window."""
        anc = self.cache.mask[:, lo + 1 : hi + 1, 1 : hi + 1]
        W = self.draft.config.window
        if d > W:
            depths = tree.depth_tensor(anc.device)[1 : hi + 1]
            anc = anc & (depths >= d - W)[None, None, :]
        return anc

    # --- checks -----------------------------------------------------------------------------------------------------

    def _check(self, state: DecodeState, tree: TreeSpec) -> None:
        """The target must fit the draft (vocabulary, geometry, cache dtype) and the tree the vocabulary."""
        draft = self.draft
        check_target_compatible(draft.config, state.target)
        if state.target is not draft.target:
            warnings.warn(
                "LongSpecDrafter: the decoded target is not the model the draft was built for; the draft keeps "
                "using that model's embeddings, rotary embedding and LM head",
                stacklevel=3,
            )
        L = state.target.config.get_text_config().num_hidden_layers
        key = state.cache.key(L - 1)
        c = draft.config
        tp = getattr(state.cache, "tp", None)
        heads = c.num_key_value_heads if tp is None else tp.local_kv_heads  # a tensor-parallel rank's share
        if key.shape[2:] != (heads, c.head_dim) or key.dtype != draft.dtype:
            raise ValueError(
                f"the target's last-layer cache is {key.dtype} [B, N, {key.shape[2]}, {key.shape[3]}], the draft "
                f"needs {draft.dtype} [B, N, {heads}, {c.head_dim}]"
            )
        width, V = 1, draft.draft_vocab_size
        for d, k in enumerate(tree.shape, start=1):
            if k > width * V:
                raise ValueError(f"tree level {d} asks for {k} nodes but its parents offer only {width * V} choices")
            width = k


__all__ = ["LongSpecDraftCache", "LongSpecDrafter"]
