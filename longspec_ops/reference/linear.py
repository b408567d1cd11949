"""Pure-PyTorch reference of ``fused_linear`` (its CPU kernel, its CUDA path above 16 rows, and the test oracle).

``fused_linear`` is the draft level's linear with its neighbours folded in: an RMSNorm before it, a SwiGLU after
a packed gate/up projection, a residual add after it. The reference is exactly the unfused composition the draft
block ran before (transformers' ``LlamaRMSNorm``, ``F.linear``, ``F.silu(gate) * up``, ``residual + y``), so a
CPU draft computes the same bits either way.

    x          [..., K]        input rows;           weight [N, K], bias [N] or None
    norm_weight [K] or None    RMSNorm of x first (statistics in float32, ``eps`` added to the mean square)
    swiglu     bool            weight is [gate; up] (N = 2 I): y = silu(x W_gate^T + b_gate) * (x W_up^T + b_up)
    residual   [..., N'] or None   y = residual + y (N' = N, or I with swiglu)
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from .invariant import rms_norm


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                 residual: Optional[Tensor], swiglu: bool) -> Tensor:
    """``[residual +] act(linear(norm(x)))`` as separate PyTorch ops; every intermediate in x's dtype."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y
