"""Triton CUDA kernels of the ``longspec`` attention ops (see :mod:`longspec_ops.kernels.attention`).

The three launchers take already-validated arguments (``longspec_ops._checks``) on one device and return
``(out [B, M, Hq, D] contiguous in q's dtype, lse float32 [B, Hq, M])``. Tile configs (``AttnConfig``), the
default tables and the hybrid backend choice (``HybridBackend``) live in :mod:`longspec_ops.kernels.attention`.
"""
from __future__ import annotations

from .attention import hybrid_tree_attn, prefix_attn, tree_attn

__all__ = ["hybrid_tree_attn", "prefix_attn", "tree_attn"]
