"""The drafter protocol: the only way :class:`~longspec.decode.decoder.SpeculativeDecoder` talks to a drafter.

A round: the engine holds, per batch row, ``seqlens[b]`` committed tokens (their K/V are in the target's cache at
rows ``[0, seqlens[b])``, token j at absolute position j) and one *pending* token, the root, at position
``seqlens[b]`` (sampled by the target, not yet in its cache). The drafter proposes a tree rooted at that token;
the target verifies it in one forward pass; the accepted path (root first) is committed, and the bonus token
becomes the next root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from longspec.model.target import StaticKVCache


@dataclass(frozen=True)
class TreeSpec:
    """A static tree layout: ``shape[d]`` nodes at depth d + 1, flat in level order after the root (index 0).

    ``(4, 16, 16, 16, 16)`` gives 69 nodes (the paper's beam tree); ``(1, 1, 1, 1)`` is a chain of 4 drafts.

    ``parts``: the per-drafter shapes of a merged layout (:meth:`merged`, for
    :class:`~longspec.decode.merge.MergedDrafter`); empty for a single drafter. In a merged layout, level d holds
    part 0's depth-d nodes, then part 1's, and so on, so ``shape`` is the elementwise sum of the parts' shapes.
    """

    shape: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...] = ()
    depths: tuple[int, ...] = field(init=False)  # depth of every node, root = 0
    offsets: tuple[int, ...] = field(init=False)  # first node index of every depth, root included
    # depth_tensor's per-device copies: building one from a Python list is a host-to-device copy, which syncs the
    # stream and cannot run inside a CUDA-graph capture, so it happens once per device
    _depth_tensors: dict = field(init=False, default_factory=dict, repr=False, compare=False, hash=False)
    # part_specs' layouts, made once: each keeps its own depth_tensor copies, so a captured propose of a merged tree
    # never copies from the host inside the capture
    _parts: list = field(init=False, default_factory=list, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"tree_shape must be a non-empty sequence of positive node counts, got {self.shape}")
        object.__setattr__(self, "shape", shape)
        parts = tuple(tuple(int(s) for s in p) for p in self.parts)
        if parts and _sum_shapes(parts) != shape:
            raise ValueError(f"a merged tree's shape must be the elementwise sum of its parts {parts}, got {shape}")
        object.__setattr__(self, "parts", parts)
        offsets = [0, 1]
        for s in shape:
            offsets.append(offsets[-1] + s)
        object.__setattr__(self, "offsets", tuple(offsets))
        depths = [0]
        for d, s in enumerate(shape, start=1):
            depths += [d] * s
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def merged(cls, *part_shapes: Sequence[int]) -> "TreeSpec":
        """The layout of one tree merged from several drafters' trees (``()`` for a part that sits out)."""
        parts = tuple(tuple(int(s) for s in p) for p in part_shapes)
        if len(parts) < 2 or any(s < 1 for p in parts for s in p) or not any(parts):
            raise ValueError(f"part_shapes must be two or more shapes of positive node counts, not all empty, got "
                             f"{part_shapes}")
        return cls(_sum_shapes(parts), parts)

    @property
    def num_nodes(self) -> int:
        return self.offsets[-1]

    @property
    def depth(self) -> int:
        return len(self.shape)

    def truncate(self, depth: int) -> "TreeSpec":
        """The first ``depth`` levels (of every part): the tree a drafter grows under a depth limit."""
        if not 1 <= depth <= self.depth:
            raise ValueError(f"depth must be in [1, {self.depth}], got {depth}")
        if not self.parts:
            return TreeSpec(self.shape[:depth])
        return TreeSpec(self.shape[:depth], tuple(p[:depth] for p in self.parts))

    def part_specs(self) -> list[Optional["TreeSpec"]]:
        """Each part's own layout (None for a part that sits out); ``[self]`` for a single drafter."""
        if not self.parts:
            return [self]
        if not self._parts:
            self._parts.extend(TreeSpec(p) if p else None for p in self.parts)
        return list(self._parts)

    def part_nodes(self) -> list[list[int]]:
        """For every part, the merged index of each of its nodes (its own level order, root first: index 0)."""
        if not self.parts:
            return [list(range(self.num_nodes))]
        out = [[0] for _ in self.parts]
        for d in range(1, self.depth + 1):
            at = self.offsets[d]
            for i, p in enumerate(self.parts):
                n = p[d - 1] if d <= len(p) else 0
                out[i] += range(at, at + n)
                at += n
        return out

    def node_parts(self) -> tuple[int, ...]:
        """The part each node belongs to (the root: 0)."""
        owner = [0] * self.num_nodes
        for i, nodes in enumerate(self.part_nodes()):
            for j in nodes[1:]:
                owner[j] = i
        return tuple(owner)

    def depth_tensor(self, device: torch.device | str) -> Tensor:
        """int64 [T]: the depth of every node (cached per device; do not modify it in place)."""
        device = torch.device(device)
        if device not in self._depth_tensors:
            self._depth_tensors[device] = torch.tensor(self.depths, dtype=torch.int64, device=device)
        return self._depth_tensors[device]


def _sum_shapes(parts: Sequence[Sequence[int]]) -> tuple[int, ...]:
    depth = max((len(p) for p in parts), default=0)
    return tuple(sum(p[d] for p in parts if d < len(p)) for d in range(depth))


@dataclass
class DraftTree:
    """What a drafter proposes for one round (all rows at once).

    tokens:  int64 [B, T]  node tokens, parents before children; ``tokens[:, 0]`` is the root. Fixed-shape drafters
             use the TreeSpec's level order.
    parents: int64 [B, T]  parent node index; -1 for the root; a depth-d node's parent has depth d - 1.
    mask:    bool [B, T, T] or None: the ancestor-or-self mask (``mask[b, i, j]``: node j is node i or one of its
             ancestors), when the drafter built it anyway; the engine then uses it as is (it must equal
             :func:`~longspec.decode.tree.tree_mask_from_parents` of ``parents``), else the engine builds it.
    depths:  int64 [B, T] or None: every node's depth, per row (a dynamic tree's rows differ); None means the
             TreeSpec's level-order depths for every row.
    scores:  float32 [B, T] or None: the drafter's log-probability of each node's path from the root (root 0;
             -inf for a node it does not vouch for, such as a filler or a duplicate). Budgets rank nodes by it.
    sources: int64 [B, T] or None: which drafters proposed each node, as a bitmask over a merged drafter's parts
             (None: one drafter, bit 0).
    Siblings should be distinct tokens, in the drafter's preferred order (verification visits them in index
    order); duplicates are allowed and only cost acceptance.
    """

    tokens: Tensor
    parents: Tensor
    mask: Optional[Tensor] = None
    depths: Optional[Tensor] = None
    scores: Optional[Tensor] = None
    sources: Optional[Tensor] = None


@dataclass
class DecodeState:
    """The engine's state as a drafter sees it (read-only for drafters).

    target:  the Hugging Face causal LM being decoded.
    cache:   the target's :class:`~longspec.model.target.StaticKVCache`; ``cache.seqlens`` (int32 [B]) are the
             committed lengths, ``cache.key(layer)`` / ``cache.value(layer)`` the ``[B, N, Hkv, D]`` views.
    tokens:  int64 [B, C] committed tokens per row, left-aligned: ``tokens[b, :seqlens[b]]`` are valid, and
             ``tokens[b, seqlens[b]] == root[b]`` (so a drafter can read the context including the root in place).
    root:    int64 [B] the pending token of every row, at position ``seqlens[b]``.
    active:  bool [B] rows still generating (finished rows may be given any tree; their output is discarded).
    max_depth: the deepest node the engine verifies, so a round commits at most ``max_depth + 1`` tokens per row
             (None: the depth of the tree given to the drafter). It exceeds that tree's depth when the drafter is
             one part of a merged tree.
    """

    target: "PreTrainedModel"
    cache: "StaticKVCache"
    tokens: Tensor
    root: Tensor
    active: Tensor
    max_depth: Optional[int] = None

    @property
    def seqlens(self) -> Tensor:
        return self.cache.seqlens


@runtime_checkable
class Drafter(Protocol):
    """A source of draft trees. Implementations keep their own state between calls, keyed to ``DecodeState``.

    Optional attributes the engine reads when present: ``vocab_size`` (checked against the target's),
    ``reads_all_target_layers`` (default True; False means only the last layer's cache rows and the token ids are
    read, which allows ``KVUpdate.REFEED``), and ``graph_state()``: a drafter whose ``propose`` makes no host sync,
    keeps static shapes and reads the ``DecodeState`` tensors in place returns the tensors ``propose`` mutates, and
    the engine (with ``cuda_graphs=True``) then captures ``propose`` as a CUDA graph once per ``generate`` (the
    warm-up run before capture is undone by restoring those tensors). Without it, ``propose`` runs eagerly.
    ``compilable``: True when ``torch.compile(propose, fullgraph=True)`` traces (no host syncs, no Python control
    flow on tensor values), and so does ``observe``; the engine compiles both when built with ``compile=True``. A
    drafter that is not compilable as a whole may offer ``compiled_calls(compile_fn)`` instead: its ``(propose,
    observe)`` with the parts that are passed through ``compile_fn`` (:class:`~longspec.decode.merge.MergedDrafter`
    compiles its parts so).
    ``nbytes()``: the device memory the drafter holds, for reports.
    ``observe(state, tree)``: catch up on the tokens committed since the last call without proposing, for the
    rounds an adaptive budget (:mod:`~longspec.decode.budget`) verifies no tree of this drafter (a plain round, or a
    merged tree without it); like ``propose`` it must be capturable when ``graph_state()`` is offered. Without
    it, the engine calls ``prefill`` again before the drafter's next ``propose``.
    """

    def prefill(self, state: DecodeState, tree: TreeSpec) -> None:
        """Called once per ``generate`` after the target's prefill (``seqlens`` = prompt lengths), and again (on
        the same batch) after rounds the drafter sat out when it has no ``observe``."""
        ...

    def propose(self, state: DecodeState, tree: TreeSpec) -> DraftTree:
        """Return a tree of ``tree.num_nodes`` nodes per row rooted at ``state.root``.

        Between two calls (of ``propose`` or ``observe``) the engine committed each row's accepted path (root
        included), so ``seqlens`` grew by 1..max_depth+1 (``state.max_depth``, default ``tree.depth``); the tokens
        committed since the last call are ``tokens[b, old_seqlens[b]:seqlens[b]]``. Under an adaptive budget
        ``tree`` may be a depth-truncated prefix (:meth:`TreeSpec.truncate`) of the tree given to ``prefill``.
        """
        ...
