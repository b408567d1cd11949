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
    x_fp8      bool            with a float8 weight: x (after the norm) is quantized too (:func:`quantize_fp8_groups`:
                               float8_e4m3fn, one power-of-two scale per row and run of :data:`X_FP8_GROUP` columns),
                               so the GEMM is float8 x float8 on the tensor cores with no conversion in its K loop;
                               the product is exact in float32, so only the accumulation order differs from the kernel
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .invariant import rms_norm


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
X_FP8_GROUP = 128  # x columns per scale when fused_linear quantizes x (x_fp8): one K step of the kernel


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


def quantize_fp8_groups(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [..., K]`` (K a multiple of :data:`X_FP8_GROUP`) -> ``(float8_e4m3fn [..., K], float32 scale [..., K / G])``
    with ``x ~ q * scale`` per run of G columns. Each run's scale is the power of two ``2^(E - 134)`` (E: the biased
    binary exponent of the run's largest magnitude in float32, at least 8), which puts that magnitude in [128, 256):
    below 448, so nothing saturates, and scaling by a power of two is exact, so the only rounding is float32 ->
    float8_e4m3fn (nearest, ties to even), the same on every device."""
    if x.shape[-1] % X_FP8_GROUP:
        raise ValueError(f"quantize_fp8_groups: x's last dimension must be a multiple of {X_FP8_GROUP}, got "
                         f"{tuple(x.shape)}")
    xf = x.float().unflatten(-1, (-1, X_FP8_GROUP))
    amax = xf.abs().amax(-1)
    e = ((amax.view(torch.int32) >> 23) & 0xFF).clamp_min(8)
    scale = ((e - 7) << 23).view(torch.float32)  # 2^(E - 134)
    q = (xf * ((261 - e) << 23).view(torch.float32)[..., None]).to(torch.float8_e4m3fn)  # x * 2^(134 - E)
    return q.flatten(-2), scale


def _scaled_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale: Tensor, x_fp8: bool = False) -> Tensor:
    """``x @ (weight * scale[:, None])^T + bias`` accumulated in float32 (float64 for float64 x), rounded once;
    ``x_fp8``: x replaced by its float8 groups (:func:`quantize_fp8_groups`), dequantized exactly."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x_fp8:
        q, x_scale = quantize_fp8_groups(x)
        xa = (q.to(acc).unflatten(-1, (-1, X_FP8_GROUP)) * x_scale.to(acc)[..., None]).flatten(-2)
    else:
        xa = x.to(acc)
    y = F.linear(xa, weight.to(acc)) * scale.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                 residual: Optional[Tensor], swiglu: bool, weight_scale: Optional[Tensor] = None,
                 x_fp8: bool = False) -> Tensor:
    """``[residual +] act(linear(norm(x)))`` as separate PyTorch ops; every intermediate in x's dtype."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if weight_scale is not None:
        y = _scaled_linear(x, weight, bias, weight_scale, x_fp8)
    else:
        y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y
