"""Pure-PyTorch reference of ``fused_linear`` (its CPU kernel, its CUDA path above 16 rows, and the test oracle).

``fused_linear`` is the draft level's linear with its neighbours folded in: an RMSNorm before it, a SwiGLU after
a packed gate/up projection, a residual add after it. The reference is exactly the unfused composition the draft
block ran before (transformers' ``LlamaRMSNorm``, ``F.linear``, ``F.silu(gate) * up``, ``residual + y``), so a
CPU draft computes the same bits either way.

    x          [..., K]        input rows;           weight [N, K], bias [N] or None
    norm_weight [K] or None    RMSNorm of x first (statistics in float32, ``eps`` added to the mean square)
    swiglu     bool            weight is [gate; up] (N = 2 I): y = silu(x W_gate^T + b_gate) * (x W_up^T + b_up)
    residual   [..., N'] or None   y = residual + y (N' = N, or I with swiglu)
    weight_scale [N] float32 or None  weight is float8_e4m3fn, row n standing for ``weight[n] * weight_scale[n]``
                                      (:func:`quantize_fp8_rows`): the product accumulates in float32 (float64 for a
                                      float64 x), is scaled per output column, gets the bias, and is rounded to x's
                                      dtype once
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .invariant import rms_norm


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight [N, K]`` -> ``(float8_e4m3fn [N, K], float32 scale [N])`` with ``weight[n] ~ w8[n] * scale[n]``:
    each row scaled so its largest magnitude maps to 448 (round to nearest even); an all-zero row gets scale 1."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_fp8_rows: weight must be a floating-point [N, K] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    w8 = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, scale


def _scaled_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Tensor) -> Tensor:
    """``x @ (weight * scale[:, None])^T + bias`` accumulated in float32 (float64 for float64 x), rounded once."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.linear(x.to(acc), weight.to(acc)) * scale.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                 residual: Optional[Tensor], swiglu: bool, weight_scale: Optional[Tensor] = None) -> Tensor:
    """``[residual +] act(linear(norm(x)))`` as separate PyTorch ops; every intermediate in x's dtype."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if weight_scale is not None:
        y = _scaled_linear(x, weight, bias, weight_scale)
    else:
        y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y
