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
parameters' values, so :class:`Fp8Weights` records each source's version counter and :func:`packed_or_none`
drops the copies once a source was written in place (an optimiser step), and the drafter quantizes again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from longspec_ops.reference.linear import quantize_fp8_rows


@dataclass(frozen=True)
class Packed:
    """qkv_weight ``[(Hq + 2 Hkv) D, H]`` (+ qkv_bias), gate_up_weight ``[2 I, H]`` (+ gate_up_bias or None)."""

    qkv_weight: Tensor
    qkv_bias: Optional[Tensor]
    gate_up_weight: Tensor
    gate_up_bias: Optional[Tensor]
    members: tuple[tuple[nn.Parameter, Tensor], ...]  # (parameter, the packed tensor it must be a view of)
    fp8: Optional["Fp8Weights"] = None  # float8 copies of the drafting linears (quantize_linears), or 16-bit


@dataclass(frozen=True)
class Fp8Weights:
    """``weights[name] = (float8_e4m3fn [N, K], float32 scale [N])`` of each drafting linear, quantized from
    ``sources`` (the tensors whose values they copy) at their ``versions``."""

    weights: dict[str, tuple[Tensor, Tensor]]
    sources: tuple[Tensor, ...]
    versions: tuple[int, ...]

    def current(self) -> bool:
        """Whether no source was written in place since the copies were made (inference tensors keep no version
        counter: theirs count as current)."""
        return all(_version(t) == v for t, v in zip(self.sources, self.versions))


def _version(t: Tensor) -> int:
    return -1 if t.is_inference() else t._version


def quantize_linears(weights: dict[str, Tensor]) -> Fp8Weights:
    """Per-row float8 copies of ``weights`` (name -> ``[N, K]``), remembering the sources' versions."""
    with torch.no_grad():
        q = {name: quantize_fp8_rows(w) for name, w in weights.items()}
    sources = tuple(weights.values())
    return Fp8Weights(q, sources, tuple(_version(t) for t in sources))


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


def pack_projections(attn: nn.Module, mlp: nn.Module) -> Packed:
    """Pack ``attn``'s q/k/v and ``mlp``'s gate/up projections (see the module docstring)."""
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_proj, mlp.up_proj]
    with torch.no_grad():
        qkv_w, qkv_b = _pack(qkv, "weight"), _pack(qkv, "bias")
        gu_w, gu_b = _pack(gate_up, "weight"), _pack(gate_up, "bias")
    members = tuple((getattr(m, a), t) for group, w, b in ((qkv, qkv_w, qkv_b), (gate_up, gu_w, gu_b))
                    for m in group for a, t in (("weight", w), ("bias", b)) if t is not None)
    return Packed(qkv_w, qkv_b, gu_w, gu_b, members)


def packed_or_none(packed: Optional[Packed]) -> Optional[Packed]:
    """``packed`` if every member parameter still lives inside its packed tensor, else None."""
    if packed is None or (packed.fp8 is not None and not packed.fp8.current()):
        return None
    for param, base in packed.members:
        start = base.data_ptr()
        end = start + base.numel() * base.element_size()
        if (param.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                or not start <= param.data_ptr() < end or param.dtype != base.dtype):
            return None
    return packed
