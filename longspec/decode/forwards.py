"""The target's forwards a decoder runs: the chunked prefill, the decode step, the tree verify (and its REFEED
variant), each on a slot's cache, the decode and verify ones replayed from CUDA graphs held by the slot."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from longspec.model.invariant import InvariantTarget
from longspec.model.target import StaticKVCache, forward_extend, forward_tree, lm_logits

from .graphs import CapturedCall
from .prompt import Prompt
from .slot import Slot
from .tree import prefix_tree_mask, tree_positions


class TargetForwards:
    """The target's forwards for one decoder: ``invariant`` (:class:`~longspec.model.invariant.InvariantTarget` or
    None) makes the decode and verify ones batch-invariant (``Numerics.INVARIANT``); ``cuda_graphs`` replays them
    from graphs captured once per slot and input shapes."""

    def __init__(self, target: torch.nn.Module, invariant: Optional[InvariantTarget], cuda_graphs: bool,
                 prefill_chunk_size: int) -> None:
        self.target = target
        self.invariant = invariant
        self.cuda_graphs = cuda_graphs
        self.prefill_chunk_size = prefill_chunk_size

    def get(self, slot: Slot, name: str) -> Callable[..., Tensor]:
        """The forward ``name`` (``"decode"``, ``"verify"`` or ``"refeed"``) on ``slot``'s cache, or its CUDA graph
        (from :mod:`~longspec.decode.graphs`, kept in ``slot.forwards``)."""
        fn = functools.partial({"decode": self.decode, "verify": self.verify, "refeed": self.refeed}[name], slot.cache)
        if not self.cuda_graphs or slot.cache.kv.device.type != "cuda":
            return fn
        if name not in slot.forwards:
            slot.forwards[name] = CapturedCall(fn)
        return slot.forwards[name]

    def prefill(self, cache: StaticKVCache, prompt: Prompt) -> Tensor:
        """Write the prompt's K/V chunk by chunk; float32 logits ``[B, 1, V]`` at each row's last prompt token."""
        B, S = prompt.tokens.shape
        last = (prompt.lens - 1)[:, None, None]
        hidden_last = None
        for lo in range(0, S, self.prefill_chunk_size):
            hi = min(lo + self.prefill_chunk_size, S)
            cache.seqlens.fill_(lo)  # rows past a short prompt's end get filler K/V, never visible later
            hidden = forward_extend(self.target, cache, prompt.tokens[:, lo:hi])
            idx = (last - lo).clamp(0, hi - lo - 1).expand(B, 1, hidden.shape[-1])
            picked = hidden.gather(1, idx)
            in_chunk = ((last[:, 0, 0] >= lo) & (last[:, 0, 0] < hi))[:, None, None]
            hidden_last = picked if hidden_last is None else torch.where(in_chunk, picked, hidden_last)
        return lm_logits(self.target, hidden_last)

    def decode(self, cache: StaticKVCache, root: Tensor) -> Tensor:
        """Logits ``[B, 1, V]`` of the pending tokens ``root`` (int64 ``[B, 1]``), written at ``seqlens``."""
        with self._numerics():
            hidden = forward_extend(self.target, cache, root, invariant=self.invariant is not None)
            return lm_logits(self.target, hidden)

    def verify(self, cache: StaticKVCache, tokens: Tensor, mask: Tensor, depths: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` at every node of the tree ``tokens`` under ``mask``, nodes at ``depths``."""
        positions = tree_positions(cache.seqlens, depths)
        with self._numerics():
            hidden = forward_tree(self.target, cache, tokens, positions, mask, invariant=self.invariant is not None)
            return lm_logits(self.target, hidden)

    def refeed(self, cache: StaticKVCache, pending: Tensor, pending_len: Tensor, tokens: Tensor, mask: Tensor,
               depths: Tensor) -> Tensor:
        """REFEED verify: ``[pending path (R slots) | tree]`` over the rows every layer holds; tree logits only."""
        R = pending.shape[1]
        held = cache.seqlens - pending_len.to(torch.int32)  # rows valid in every layer
        ids = torch.cat([pending, tokens], dim=1)
        positions = torch.cat([held.to(torch.int64)[:, None] + torch.arange(R, device=ids.device),
                               tree_positions(cache.seqlens, depths)], dim=1)
        full_mask = prefix_tree_mask(pending_len, R, mask)
        hidden = forward_tree(self.target, cache, ids, positions, full_mask, seqlens=held)
        return lm_logits(self.target, hidden[:, R:])

    def _numerics(self) -> contextlib.AbstractContextManager:
        """The target's invariant linears and norms for one forward (Numerics.INVARIANT), else nothing."""
        return self.invariant.active() if self.invariant is not None else contextlib.nullcontext()


__all__ = ["TargetForwards"]
