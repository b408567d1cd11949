"""longspec_ops: the ``torch.ops.longspec`` op surface for long-context speculative decoding.

Importing this package registers every op (schemas, fake kernels, CPU references, Triton CUDA kernels) and loads
the C++/CUDA extension ``longspec_ops._C`` when it was built. The typed wrappers below check their arguments and
fill in defaults; ``torch.ops.longspec.<name>`` is the raw op.
"""
from __future__ import annotations

import warnings

import torch

from . import _library, _library_linear  # noqa: F401  (register the ops)

try:
    from . import _C  # noqa: F401  (registers CUDA kernels for merge_attn_states and commit_kv_)

    _HAS_C = True
except ImportError as _err:  # a pure-Python install
    _HAS_C = False
    _C_IMPORT_ERROR = str(_err)
    _library.register_reference_cuda_fallbacks()
    if torch.cuda.is_available():
        warnings.warn(
            "longspec_ops._C is not built (" + _C_IMPORT_ERROR + "): merge_attn_states and commit_kv_ run the "
            "PyTorch reference on CUDA. Reinstall with LONGSPEC_BUILD_EXT=1 for the CUDA kernels.",
            stacklevel=2,
        )

from .ops import (  # noqa: E402
    beam_topk,
    commit_kv_,
    draft_cross_attn,
    fused_linear,
    hybrid_tree_attn,
    invariant_attn,
    invariant_linear,
    merge_attn_states,
    prefix_attn,
    prompt_lookup_chain,
    rms_norm,
    tree_attn,
)
from .reference.linear import quantize_fp8_rows  # noqa: E402


def has_cuda_kernels() -> bool:
    """True when the C++/CUDA extension ``longspec_ops._C`` is loaded."""
    return _HAS_C


__all__ = [
    "beam_topk",
    "commit_kv_",
    "draft_cross_attn",
    "fused_linear",
    "has_cuda_kernels",
    "hybrid_tree_attn",
    "invariant_attn",
    "invariant_linear",
    "merge_attn_states",
    "prefix_attn",
    "prompt_lookup_chain",
    "quantize_fp8_rows",
    "rms_norm",
    "tree_attn",
]
