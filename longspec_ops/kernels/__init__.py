"""Triton CUDA kernels of the ``longspec`` attention ops, by concern:

* :mod:`.attention`: the split-KV and merge kernels (Triton); :mod:`.attention_sm90`: the Gluon sm_90 split kernel;
* :mod:`.configs`: tile configs (``AttnConfig``), their default tables, the split rule, ``HybridBackend``;
* :mod:`.launch`: the three launchers below (already-validated arguments, see ``longspec_ops._checks``; they return
  ``(out [B, M, Hq, D] contiguous in q's dtype, lse float32 [B, Hq, M])``), TMA eligibility, the sm_90 dispatch.
"""
from __future__ import annotations

from .launch import hybrid_tree_attn, prefix_attn, tree_attn

__all__ = ["hybrid_tree_attn", "prefix_attn", "tree_attn"]
