"""Invariant numerics for a target: its forwards give a token's row the same bits whatever else the forward holds.

:class:`InvariantTarget` switches, for the forwards inside :meth:`InvariantTarget.active`, every ``nn.Linear`` of
the decoder layers and the LM head to ``longspec::invariant_linear`` and every RMSNorm (the layers' norms, Qwen3's
q/k norms, the final norm) to ``longspec::rms_norm``: kernels whose per-row reduction order does not depend on the
number of rows (:mod:`longspec_ops.kernels.invariant`). The rest of a layer is row-local already (embedding
lookups, RoPE, SiLU * up, residual adds); attention goes through ``longspec::invariant_attn`` when the forward's
:class:`~longspec.model.target.AttentionStep` carries ancestors (``forward_extend`` / ``forward_tree`` with
``invariant=True``). No model file is forked and nothing stays patched outside the block: the modules' own
``forward`` is shadowed by an instance attribute that is removed again on exit.
"""
from __future__ import annotations

import contextlib
import types
from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor, nn

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return torch.ops.longspec.invariant_linear(x, self.weight, self.bias)


def _rms_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    return torch.ops.longspec.rms_norm(x, self.weight, float(self.variance_epsilon))


def is_rms_norm(module: nn.Module) -> bool:
    """transformers' Llama-style RMSNorm (``weight * normalised(x)``, a ``variance_epsilon``): Llama, Mistral,
    Qwen2 and Qwen3 all use it."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and isinstance(weight, Tensor) and weight.dim() == 1)


class InvariantTarget:
    """The invariant forwards of ``model``'s linears and norms, switched on inside :meth:`active`.

    The bound forwards are made once, so a ``torch.compile``d layer sees the same functions on every entry.
    """

    def __init__(self, model: "PreTrainedModel") -> None:
        base = model.base_model
        modules = [*base.layers.modules(), base.norm, model.get_output_embeddings()]
        self._forwards: dict[nn.Module, types.MethodType] = {}
        for m in modules:
            if isinstance(m, nn.Linear):
                self._forwards[m] = types.MethodType(_linear_forward, m)
            elif is_rms_norm(m):
                self._forwards[m] = types.MethodType(_rms_norm_forward, m)

    @property
    def modules(self) -> list[nn.Module]:
        return list(self._forwards)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for m, forward in self._forwards.items():
            m.forward = forward
        try:
            yield
        finally:
            for m in self._forwards:
                m.__dict__.pop("forward", None)


def tree_ancestors(tree_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each node's ancestors in depth order, from an ancestor-or-self mask whose parents precede their children.

    Args:
        tree_mask: bool ``[B, T, T]``, ``tree_mask[b, i, j]``: node j is node i or one of its ancestors.

    Returns:
        ``(ancestors int32 [B, T, T], depths int32 [B, T])``: ``ancestors[b, i, d]`` is the index of node i's
        depth-d ancestor for ``d <= depths[b, i]`` (``d = depths[b, i]``: node i itself); later entries are
        unspecified.
    """
    depths = tree_mask.sum(-1, dtype=torch.int32) - 1
    # A stable sort puts the True columns first, in index order, which is depth order since parents come first.
    ancestors = torch.sort((~tree_mask).to(torch.uint8), dim=-1, stable=True).indices
    return ancestors.to(torch.int32), depths


def chain_ancestors(batch: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`tree_ancestors` of ``length`` tokens appended in order (plain decoding: ``length = 1``)."""
    idx = torch.arange(length, dtype=torch.int32, device=device)
    return idx.expand(batch, length, length).contiguous(), idx.expand(batch, length).contiguous()
