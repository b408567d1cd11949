"""Packed projection weights for drafting: one GEMM for the self-attention's q/k/v and one for the MLP's gate/up.

A draft level at M <= 16 rows is a chain of memory-bound GEMMs; three small ones (q, k, v) and two large ones (gate,
up) launch five kernels where two read the same bytes. :func:`pack_projections` concatenates each group's weights
(and biases) into one tensor and re-points the parameters at views of it, so the values and the state dict are
unchanged and no weight is held twice. ``LongSpecDraft`` uses the packed tensors when gradients are off (drafting);
training sees the parameters as ever (a GEMM on the packed base would not reach the parameters' gradients).

The packing is a layout of the parameters' storage, so anything that gives a parameter new storage (``.to()``,
``load_state_dict(assign=True)``) undoes it; :func:`packed_or_none` notices (the views no longer alias the packed
tensors) and the drafter packs again at its next prefill.

**Float8 drafting weights** (:func:`quantize_linears`): drafting may read every linear of a level as
``float8_e4m3fn`` with one float32 scale per output row (``longspec::fused_linear``'s ``weight_scale``), half the
bytes of a 16-bit weight, since a level's GEMMs over <= 16 rows are weight reads. These are copies made from the
parameters' values, so :class:`Fp8Weights` records each source's version counter, and packing again after a
source was written in place (an optimiser step) quantizes it again into the same tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from longspec.model.draft_files import _is_dtensor
from longspec_ops.reference.linear import quantize_fp8_rows


@dataclass(frozen=True)
class Packed:
    """qkv_weight ``[(Hq + 2 Hkv) D, H]`` (+ qkv_bias), gate_up_weight ``[2 I, H]`` (+ gate_up_bias or None); each
    extra cross block's MLP's (gate_up weight, bias or None) in ``extra_gate_up``."""

    qkv_weight: Tensor
    qkv_bias: Optional[Tensor]
    gate_up_weight: Tensor
    gate_up_bias: Optional[Tensor]
    members: tuple[tuple[nn.Parameter, Tensor], ...]  # (parameter, the packed tensor it must be a view of)
    fp8: Optional["Fp8Weights"] = None  # float8 copies of the drafting linears (quantize_linears), or 16-bit
    extra_gate_up: tuple[tuple[Tensor, Optional[Tensor]], ...] = ()

    def gate_up(self, part: Optional[int]) -> tuple[Tensor, Optional[Tensor]]:
        """(packed gate/up weight, bias or None) of the block's MLP (``part`` None) or extra block ``part``'s."""
        return (self.gate_up_weight, self.gate_up_bias) if part is None else self.extra_gate_up[part]

    def weight(self, name: str, weight: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """(weight, float8 row scales or None) drafting reads for ``name``: its float8 copy, else ``weight``."""
        if self.fp8 is not None and name in self.fp8.weights:
            return self.fp8.weights[name]
        return weight, None


@dataclass
class Fp8Weights:
    """``weights[name] = (float8_e4m3fn [N, K], float32 scale [N])`` of each drafting linear, quantized from
    ``sources`` (the tensors whose values they copy) at their ``versions``."""

    weights: dict[str, tuple[Tensor, Tensor]]
    sources: dict[str, Tensor]
    versions: dict[str, int]

    def current(self) -> bool:
        """Whether no source was written in place since the copies were made (inference tensors keep no version
        counter: theirs count as current)."""
        return all(_version(t) == self.versions[name] for name, t in self.sources.items())

    def covers(self, sources: dict[str, Tensor]) -> bool:
        """Whether these copies were made from ``sources`` (the same memory and shapes, by name)."""
        return self.sources.keys() == sources.keys() and all(
            t.data_ptr() == sources[n].data_ptr() and t.shape == sources[n].shape for n, t in self.sources.items())

    def refresh(self) -> None:
        """Quantize the sources written since into the same tensors, in place: CUDA graphs captured on the copies
        read the new values (new tensors would leave them reading freed memory)."""
        with torch.no_grad():
            for name, t in self.sources.items():
                if _version(t) != self.versions[name]:
                    w8, scale = quantize_fp8_rows(t)
                    self.weights[name][0].copy_(w8)
                    self.weights[name][1].copy_(scale)
                    self.versions[name] = _version(t)


def _version(t: Tensor) -> int:
    return -1 if t.is_inference() else t._version


def check_weight_dtype(weight_dtype: Optional[torch.dtype], draft_dtype: torch.dtype, where: str) -> bool:
    """Whether ``weight_dtype`` asks for float8 drafting weights; ValueError unless it is None, ``draft_dtype`` or
    ``torch.float8_e4m3fn``."""
    if weight_dtype not in (None, draft_dtype, torch.float8_e4m3fn):
        raise ValueError(f"{where}: weight_dtype must be None, the draft's dtype {draft_dtype} or "
                         f"torch.float8_e4m3fn, got {weight_dtype}")
    return weight_dtype == torch.float8_e4m3fn


def quantize_linears(weights: dict[str, Tensor]) -> Fp8Weights:
    """Per-row float8 copies of ``weights`` (name -> ``[N, K]``), remembering the sources' versions."""
    with torch.no_grad():
        q = {name: quantize_fp8_rows(w) for name, w in weights.items()}
    return Fp8Weights(q, dict(weights), {name: _version(t) for name, t in weights.items()})


def _pack(layers: list[nn.Linear], attr: str) -> Optional[Tensor]:
    params = [getattr(m, attr) for m in layers]
    if any(p is None for p in params):
        return None
    packed = torch.cat([p.detach() for p in params], dim=0)
    row = 0
    for p in params:
        n = p.shape[0]
        p.data = packed[row:row + n]  # the parameter now lives inside the packed tensor: no second copy
        row += n
    return packed


def pack_projections(attn: nn.Module, mlp: nn.Module, extra_mlps: Sequence[nn.Module] = ()) -> Packed:
    """Pack ``attn``'s q/k/v and the gate/up projections of ``mlp`` and of each of ``extra_mlps`` (see the module
    docstring)."""
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    groups = [qkv] + [[m.gate_proj, m.up_proj] for m in (mlp, *extra_mlps)]
    with torch.no_grad():
        packs = [(_pack(group, "weight"), _pack(group, "bias")) for group in groups]
    members = tuple((getattr(m, a), t) for group, (w, b) in zip(groups, packs)
                    for m in group for a, t in (("weight", w), ("bias", b)) if t is not None)
    (qkv_w, qkv_b), (gu_w, gu_b) = packs[:2]
    return Packed(qkv_w, qkv_b, gu_w, gu_b, members, extra_gate_up=tuple(packs[2:]))


def drafting_weights(draft: nn.Module, packed: Packed, head: Tensor) -> dict[str, Tensor]:
    """The weights a :class:`~longspec.model.draft.LongSpecDraft` level reads while drafting, by name (``head``: its
    drafting LM head rows; a tensor-parallel head keeps its own path and is left out; extra block i's under the
    prefix ``x{i}.``)."""
    weights = {"qkv": packed.qkv_weight, "self_o": draft.self_attn.o_proj.weight,
               "cross_q": draft.cross_attn.q_proj.weight, "cross_o": draft.cross_attn.o_proj.weight,
               "gate_up": packed.gate_up_weight, "down": draft.mlp.down_proj.weight}
    for i, blk in enumerate(draft.extra_blocks):
        weights.update({f"x{i}.cross_q": blk.cross_attn.q_proj.weight, f"x{i}.cross_o": blk.cross_attn.o_proj.weight,
                        f"x{i}.gate_up": packed.extra_gate_up[i][0], f"x{i}.down": blk.mlp.down_proj.weight})
    if not _is_dtensor(head):
        weights["head"] = head
    return {name: w.detach() for name, w in weights.items()}


def fused_linear(x: Tensor, weight: tuple[Tensor, Optional[Tensor]], bias: Optional[Tensor], *,
                 norm: Optional[nn.Module] = None, residual: Optional[Tensor] = None, swiglu: bool = False) -> Tensor:
    """``[residual +] act(linear(norm(x)))`` as one ``longspec::fused_linear`` (``weight``: (weight, its float8
    row scales or None); ``norm``: an RMSNorm module)."""
    return torch.ops.longspec.fused_linear(x, weight[0], bias, None if norm is None else norm.weight,
                                           0.0 if norm is None else float(norm.variance_epsilon), residual, swiglu,
                                           weight[1])


def packed_or_none(packed: Optional[Packed]) -> Optional[Packed]:
    """``packed`` if every member parameter still lives inside its packed tensor, else None."""
    if packed is None:
        return None
    for param, base in packed.members:
        start = base.data_ptr()
        end = start + base.numel() * base.element_size()
        if (param.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                or not start <= param.data_ptr() < end or param.dtype != base.dtype):
            return None
    return packed
