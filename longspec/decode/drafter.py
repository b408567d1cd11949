"""The drafter protocol: the only way :class:`~longspec.decode.decoder.SpeculativeDecoder` talks to a drafter.

A round: the engine holds, per batch row, ``seqlens[b]`` committed tokens (their K/V are in the target's cache at
rows ``[0, seqlens[b])``, token j at absolute position j) and one *pending* token, the root, at position
``seqlens[b]`` (sampled by the target, not yet in its cache). The drafter proposes a tree rooted at that token;
the target verifies it in one forward pass; the accepted path (root first) is committed, and the bonus token
becomes the next root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from longspec.model.target import StaticKVCache


@dataclass(frozen=True)
class TreeSpec:
    """A static tree layout: ``shape[d]`` nodes at depth d + 1, flat in level order after the root (index 0).

    ``(4, 16, 16, 16, 16)`` gives 69 nodes (the paper's beam tree); ``(1, 1, 1, 1)`` is a chain of 4 drafts.
    """

    shape: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)  # depth of every node, root = 0
    offsets: tuple[int, ...] = field(init=False)  # first node index of every depth, root included
    # depth_tensor's per-device copies: building one from a Python list is a host-to-device copy, which syncs the
    # stream and cannot run inside a CUDA-graph capture, so it happens once per device
    _depth_tensors: dict = field(init=False, default_factory=dict, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"tree_shape must be a non-empty sequence of positive node counts, got {self.shape}")
        object.__setattr__(self, "shape", shape)
        offsets = [0, 1]
        for s in shape:
            offsets.append(offsets[-1] + s)
        object.__setattr__(self, "offsets", tuple(offsets))
        depths = [0]
        for d, s in enumerate(shape, start=1):
            depths += [d] * s
        object.__setattr__(self, "depths", tuple(depths))

    @property
    def num_nodes(self) -> int:
        return self.offsets[-1]

    @property
    def depth(self) -> int:
        return len(self.shape)

    def depth_tensor(self, device: torch.device | str) -> Tensor:
        """int64 [T]: the depth of every node (cached per device; do not modify it in place)."""
        device = torch.device(device)
        if device not in self._depth_tensors:
            self._depth_tensors[device] = torch.tensor(self.depths, dtype=torch.int64, device=device)
        return self._depth_tensors[device]


@dataclass
class DraftTree:
    """What a drafter proposes for one round (all rows at once).

    tokens:  int64 [B, T]  node tokens in the TreeSpec's level order; ``tokens[:, 0]`` is the root.
    parents: int64 [B, T]  parent node index; -1 for the root; a depth-d node's parent has depth d - 1.
    mask:    bool [B, T, T] or None: the ancestor-or-self mask (``mask[b, i, j]``: node j is node i or one of its
             ancestors), when the drafter built it anyway; the engine then uses it as is (it must equal
             :func:`~longspec.decode.tree.tree_mask_from_parents` of ``parents``), else the engine builds it.
    Siblings should be distinct tokens, in the drafter's preferred order (verification visits them in index
    order); duplicates are allowed and only cost acceptance.
    """

    tokens: Tensor
    parents: Tensor
    mask: Optional[Tensor] = None


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
    """

    target: "PreTrainedModel"
    cache: "StaticKVCache"
    tokens: Tensor
    root: Tensor
    active: Tensor

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
    flow on tensor values); the engine compiles it when built with ``compile=True``.
    ``nbytes()``: the device memory the drafter holds, for reports.
    """

    def prefill(self, state: DecodeState, tree: TreeSpec) -> None:
        """Called once per ``generate`` after the target's prefill (``seqlens`` = prompt lengths)."""
        ...

    def propose(self, state: DecodeState, tree: TreeSpec) -> DraftTree:
        """Return a tree of ``tree.num_nodes`` nodes per row rooted at ``state.root``.

        Between two calls the engine committed each row's accepted path (root included), so ``seqlens`` grew by
        1..depth+1; the tokens committed since the last call are ``tokens[b, old_seqlens[b]:seqlens[b]]``.
        """
        ...
