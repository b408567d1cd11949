"""Every ``longspec::*`` op: its schema, its fake (meta) kernel, its CPU kernel and its Python CUDA kernel.

One place for the whole surface, in two files: this one (attention, the KV commit, prompt lookup, beam top-k,
the acceptance statistics) and :mod:`._library_linear` (the linears and norms), on one ``Library``. Ops are registered directly on a ``torch.library.Library`` (vLLM style) rather
than through ``custom_op``/``triton_op``, which keeps eager dispatch overhead at a few microseconds; each op stays
opaque to ``torch.compile`` through its fake kernel and is safe under CUDA-graph capture.

Kernels:
  * CPU: the pure-PyTorch references in :mod:`longspec_ops.reference` (they are also the test oracles).
  * CUDA: Triton kernels in :mod:`longspec_ops.kernels` for the attention, invariant, lookup and statistics ops;
    the C++ extension ``longspec_ops._C`` (``csrc/``) registers ``merge_attn_states`` and ``commit_kv_`` for CUDA
    when it is built.
    Without it those two run the PyTorch reference on CUDA, and :func:`longspec_ops.has_cuda_kernels` says so.

Value checks (lengths within the cache) cost a host sync on CUDA, so the raw CUDA ops skip them and their kernels
clamp lengths into range (out-of-range commit rows are skipped): a bad value can never touch memory outside the
cache. The CPU ops check values, and so do the typed wrappers in :mod:`longspec_ops.ops` on every device.

Conventions (flash-attn layout): q ``[B, M, Hq, D]``; caches ``[B, N, Hkv, D]`` with rows ``[0, len)`` valid; tree
k/v ``[B, K, Hkv, D]`` under a bool ``[B, M, K]`` mask (K = M for a whole tree); lse float32 ``[B, Hq, M]`` in natural log; out has q's dtype and is contiguous. Any strides
with a contiguous last dimension are accepted. An empty key set gives out 0 and lse -inf.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _checks
from .reference import attention as ref
from .reference import beam as beam_ref
from .reference import invariant as inv_ref
from .reference import lookup as lookup_ref
from .reference import stats as stats_ref

lib = torch.library.Library("longspec", "FRAGMENT")


def _empty_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    B, M, Hq, D = q.shape
    out = torch.empty((B, M, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, M), dtype=torch.float32, device=q.device)
    return out, lse


def _kernels():
    # Imported on first CUDA call so that CPU-only use never needs a working Triton.
    from . import kernels

    return kernels


def _invariant_kernels():
    from .kernels import invariant_launch

    return invariant_launch


def _lookup_kernels():
    from .kernels import lookup

    return lookup


def _beam_kernels():
    from .kernels import beam

    return beam


def _stats_kernels():
    from .kernels import stats

    return stats


# merge_attn_states ---------------------------------------------------------------------------------------------
lib.define("merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor out, Tensor lse)")


@torch.library.register_fake("longspec::merge_attn_states", lib=lib)
def _merge_fake(out_a, lse_a, out_b, lse_b):
    _checks.check_merge(out_a, lse_a, out_b, lse_b)
    return _empty_outputs(out_a)


def _merge_impl(out_a, lse_a, out_b, lse_b):
    _checks.check_merge(out_a, lse_a, out_b, lse_b)
    out, lse = ref.merge_attn_states(out_a, lse_a, out_b, lse_b)
    return out.contiguous(), lse.contiguous()


lib.impl("merge_attn_states", _merge_impl, "CPU")

# The CUDA kernel lives in csrc/ under an internal name: the public op checks its arguments in Python first, so a
# bad call raises a clear ValueError before reaching C++ (an exception thrown inside a stable-ABI kernel crashed
# the process on torch 2.11, seen on the H200).
lib.define("_merge_attn_states_kernel(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)")


@torch.library.register_fake("longspec::_merge_attn_states_kernel", lib=lib)
def _merge_kernel_fake(out_a, lse_a, out_b, lse_b):
    return _empty_outputs(out_a)


def _merge_cuda(out_a, lse_a, out_b, lse_b):
    _checks.check_merge(out_a, lse_a, out_b, lse_b)
    return torch.ops.longspec._merge_attn_states_kernel(out_a, lse_a, out_b, lse_b)


lib.impl("merge_attn_states", _merge_cuda, "CUDA")


# tree_attn -----------------------------------------------------------------------------------------------------
lib.define("tree_attn(Tensor q, Tensor k, Tensor v, Tensor tree_mask, float scale) -> (Tensor out, Tensor lse)")


@torch.library.register_fake("longspec::tree_attn", lib=lib)
def _tree_fake(q, k, v, tree_mask, scale):
    _checks.check_tree(q, k, v, tree_mask, scale)
    return _empty_outputs(q)


def _tree_cpu(q, k, v, tree_mask, scale):
    _checks.check_tree(q, k, v, tree_mask, scale)
    out, lse = ref.tree_attn(q, k, v, tree_mask, scale)
    return out.contiguous(), lse


def _tree_cuda(q, k, v, tree_mask, scale):
    _checks.check_tree(q, k, v, tree_mask, scale)
    return _kernels().tree_attn(q, k, v, tree_mask, scale)


lib.impl("tree_attn", _tree_cpu, "CPU")
lib.impl("tree_attn", _tree_cuda, "CUDA")


# prefix_attn ---------------------------------------------------------------------------------------------------
lib.define("prefix_attn(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, float scale) -> (Tensor out, Tensor lse)")


@torch.library.register_fake("longspec::prefix_attn", lib=lib)
def _prefix_fake(q, k_cache, v_cache, kv_lens, scale):
    _checks.check_prefix(q, k_cache, v_cache, kv_lens, scale)
    return _empty_outputs(q)


def _prefix_cpu(q, k_cache, v_cache, kv_lens, scale):
    _checks.check_prefix(q, k_cache, v_cache, kv_lens, scale)
    _checks.check_lengths("prefix_attn", "kv_lens", kv_lens, k_cache.shape[1])
    out, lse = ref.prefix_attn(q, k_cache, v_cache, kv_lens, scale)
    return out.contiguous(), lse


def _prefix_cuda(q, k_cache, v_cache, kv_lens, scale):
    _checks.check_prefix(q, k_cache, v_cache, kv_lens, scale)
    return _kernels().prefix_attn(q, k_cache, v_cache, kv_lens, scale)


lib.impl("prefix_attn", _prefix_cpu, "CPU")
lib.impl("prefix_attn", _prefix_cuda, "CUDA")

# The same kernel without the argument checks, for callers that checked once per forward the arguments every layer
# repeats (longspec.model.target: the first layer goes through the public op, the rest through this one).
lib.define("_prefix_attn_kernel(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, float scale) -> (Tensor, Tensor)")


@torch.library.register_fake("longspec::_prefix_attn_kernel", lib=lib)
def _prefix_kernel_fake(q, k_cache, v_cache, kv_lens, scale):
    return _empty_outputs(q)


def _prefix_kernel_cpu(q, k_cache, v_cache, kv_lens, scale):
    out, lse = ref.prefix_attn(q, k_cache, v_cache, kv_lens, scale)
    return out.contiguous(), lse


def _prefix_kernel_cuda(q, k_cache, v_cache, kv_lens, scale):
    return _kernels().prefix_attn(q, k_cache, v_cache, kv_lens, scale)


lib.impl("_prefix_attn_kernel", _prefix_kernel_cpu, "CPU")
lib.impl("_prefix_attn_kernel", _prefix_kernel_cuda, "CUDA")


# hybrid_tree_attn ----------------------------------------------------------------------------------------------
lib.define(
    "hybrid_tree_attn("
    "Tensor q, "
    "Tensor k_cache, "
    "Tensor v_cache, "
    "Tensor cache_seqlens, "
    "Tensor k_tree, "
    "Tensor v_tree, "
    "Tensor tree_mask, "
    "float scale"
    ") -> (Tensor out, Tensor lse)"
)


@torch.library.register_fake("longspec::hybrid_tree_attn", lib=lib)
def _hybrid_fake(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale):
    _checks.check_hybrid(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale)
    return _empty_outputs(q)


def _hybrid_cpu(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale):
    _checks.check_hybrid(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale)
    _checks.check_lengths("hybrid_tree_attn", "cache_seqlens", cache_seqlens, k_cache.shape[1])
    out, lse = ref.hybrid_tree_attn(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale)
    return out.contiguous(), lse


def _hybrid_cuda(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale):
    _checks.check_hybrid(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale)
    return _kernels().hybrid_tree_attn(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale)


lib.impl("hybrid_tree_attn", _hybrid_cpu, "CPU")
lib.impl("hybrid_tree_attn", _hybrid_cuda, "CUDA")

# Unchecked twin (see _prefix_attn_kernel).
lib.define(
    "_hybrid_tree_attn_kernel(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor k_tree, "
    "Tensor v_tree, Tensor tree_mask, float scale) -> (Tensor, Tensor)"
)


@torch.library.register_fake("longspec::_hybrid_tree_attn_kernel", lib=lib)
def _hybrid_kernel_fake(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale):
    return _empty_outputs(q)


def _hybrid_kernel_cpu(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale):
    out, lse = ref.hybrid_tree_attn(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale)
    return out.contiguous(), lse


def _hybrid_kernel_cuda(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale):
    return _kernels().hybrid_tree_attn(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale)


lib.impl("_hybrid_tree_attn_kernel", _hybrid_kernel_cpu, "CPU")
lib.impl("_hybrid_tree_attn_kernel", _hybrid_kernel_cuda, "CUDA")


# draft_cross_attn ----------------------------------------------------------------------------------------------
lib.define(
    "draft_cross_attn("
    "Tensor q, "
    "Tensor k_cache, "
    "Tensor v_cache, "
    "Tensor q_pos, "
    "Tensor cache_seqlens, "
    "float scale"
    ") -> (Tensor out, Tensor lse)"
)


@torch.library.register_fake("longspec::draft_cross_attn", lib=lib)
def _draft_cross_fake(q, k_cache, v_cache, q_pos, cache_seqlens, scale):
    _checks.check_draft_cross(q, k_cache, v_cache, q_pos, cache_seqlens, scale)
    return _empty_outputs(q)


def _draft_cross_cpu(q, k_cache, v_cache, q_pos, cache_seqlens, scale):
    _checks.check_draft_cross(q, k_cache, v_cache, q_pos, cache_seqlens, scale)
    _checks.check_lengths("draft_cross_attn", "cache_seqlens", cache_seqlens, k_cache.shape[1])
    out, lse = ref.draft_cross_attn(q, k_cache, v_cache, q_pos, cache_seqlens, scale)
    return out.contiguous(), lse


def _draft_cross_cuda(q, k_cache, v_cache, q_pos, cache_seqlens, scale):
    _checks.check_draft_cross(q, k_cache, v_cache, q_pos, cache_seqlens, scale)
    kv_lens = ref.draft_kv_lens(q_pos, cache_seqlens)
    return _kernels().prefix_attn(q, k_cache, v_cache, kv_lens, scale)


lib.impl("draft_cross_attn", _draft_cross_cpu, "CPU")
lib.impl("draft_cross_attn", _draft_cross_cuda, "CUDA")


# commit_kv_ ----------------------------------------------------------------------------------------------------
lib.define(
    "commit_kv_("
    "Tensor(a!) kv_cache, "
    "Tensor cache_seqlens, "
    "Tensor accept_index, "
    "Tensor accept_lens"
    ") -> ()"
)


@torch.library.register_fake("longspec::commit_kv_", lib=lib)
def _commit_fake(kv_cache, cache_seqlens, accept_index, accept_lens):
    _checks.check_commit(kv_cache, cache_seqlens, accept_index, accept_lens)


def _commit_impl(kv_cache, cache_seqlens, accept_index, accept_lens):
    _checks.check_commit(kv_cache, cache_seqlens, accept_index, accept_lens)
    _checks.check_commit_values(kv_cache, cache_seqlens, accept_index, accept_lens)
    ref.commit_kv_(kv_cache, cache_seqlens, accept_index, accept_lens)


lib.impl("commit_kv_", _commit_impl, "CPU")

lib.define("_commit_kv_kernel(Tensor(a!) kv_cache, Tensor cache_seqlens, Tensor accept_index, Tensor accept_lens) -> ()")


@torch.library.register_fake("longspec::_commit_kv_kernel", lib=lib)
def _commit_kernel_fake(kv_cache, cache_seqlens, accept_index, accept_lens):
    return None


def _commit_cuda(kv_cache, cache_seqlens, accept_index, accept_lens):
    _checks.check_commit(kv_cache, cache_seqlens, accept_index, accept_lens)
    torch.ops.longspec._commit_kv_kernel(kv_cache, cache_seqlens, accept_index, accept_lens)


lib.impl("commit_kv_", _commit_cuda, "CUDA")


# prompt_lookup_chain -------------------------------------------------------------------------------------------
lib.define("prompt_lookup_chain(Tensor tokens, Tensor seqlens, int depth, int min_ngram, int max_ngram) "
           "-> (Tensor chain, Tensor found)")


@torch.library.register_fake("longspec::prompt_lookup_chain", lib=lib)
def _lookup_fake(tokens, seqlens, depth, min_ngram, max_ngram):
    _checks.check_lookup(tokens, seqlens, depth, min_ngram, max_ngram)
    B = tokens.shape[0]
    return tokens.new_empty((B, depth + 1)), tokens.new_empty((B,), dtype=torch.bool)


def _lookup_cpu(tokens, seqlens, depth, min_ngram, max_ngram):
    _checks.check_lookup(tokens, seqlens, depth, min_ngram, max_ngram)
    _checks.check_lookup_values(tokens, seqlens)
    return lookup_ref.prompt_lookup_chain(tokens, seqlens, depth, min_ngram, max_ngram)


def _lookup_cuda(tokens, seqlens, depth, min_ngram, max_ngram):
    _checks.check_lookup(tokens, seqlens, depth, min_ngram, max_ngram)
    return _lookup_kernels().prompt_lookup_chain(tokens, seqlens, depth, min_ngram, max_ngram)


lib.impl("prompt_lookup_chain", _lookup_cpu, "CPU")
lib.impl("prompt_lookup_chain", _lookup_cuda, "CUDA")

# beam_topk -----------------------------------------------------------------------------------------------------
lib.define("beam_topk(Tensor logits, Tensor cum_logp, int width) -> (Tensor parent, Tensor column, Tensor score)")


@torch.library.register_fake("longspec::beam_topk", lib=lib)
def _beam_fake(logits, cum_logp, width):
    _checks.check_beam(logits, cum_logp, width)
    B = logits.shape[0]
    idx = logits.new_empty((B, width), dtype=torch.int64)
    return idx, torch.empty_like(idx), logits.new_empty((B, width), dtype=torch.float32)


def _beam_cpu(logits, cum_logp, width):
    _checks.check_beam(logits, cum_logp, width)
    return beam_ref.beam_topk(logits, cum_logp, width)


def _beam_cuda(logits, cum_logp, width):
    _checks.check_beam(logits, cum_logp, width)
    return _beam_kernels().beam_topk(logits, cum_logp, width)


lib.impl("beam_topk", _beam_cpu, "CPU")
lib.impl("beam_topk", _beam_cuda, "CUDA")

# record_acceptance_ --------------------------------------------------------------------------------------------
lib.define("record_acceptance_(Tensor(a!) proposed, Tensor(b!) accepted, Tensor(c!) realised, Tensor(d!) mass, "
           "Tensor(e!) seen, Tensor keys, Tensor within, Tensor contained, Tensor accept_index, Tensor accept_len, "
           "Tensor active, float decay, float rate) -> ()")


@torch.library.register_fake("longspec::record_acceptance_", lib=lib)
def _record_fake(*args):
    _checks.check_record(*args)


def _record_cpu(*args):
    _checks.check_record(*args)
    _checks.check_record_values(args[0], args[5], args[8], args[9])
    stats_ref.record_acceptance_(*args)


def _record_cuda(*args):
    _checks.check_record(*args)
    _stats_kernels().record_acceptance_(*args)


lib.impl("record_acceptance_", _record_cpu, "CPU")
lib.impl("record_acceptance_", _record_cuda, "CUDA")

lib.define(
    "invariant_attn("
    "Tensor q, "
    "Tensor k_cache, "
    "Tensor v_cache, "
    "Tensor cache_seqlens, "
    "Tensor ancestors, "
    "Tensor depths, "
    "float scale"
    ") -> (Tensor out, Tensor lse)"
)


@torch.library.register_fake("longspec::invariant_attn", lib=lib)
def _invariant_attn_fake(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale):
    _checks.check_invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale)
    return _empty_outputs(q)


def _invariant_attn_cpu(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale):
    _checks.check_invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale)
    _checks.check_invariant_attn_values(k_cache, cache_seqlens, ancestors, depths)
    out, lse = inv_ref.invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale)
    return out.contiguous(), lse


def _invariant_attn_cuda(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale):
    _checks.check_invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale)
    if q.dtype == torch.float64:
        out, lse = inv_ref.invariant_attn(q, k_cache, v_cache, cache_seqlens.clamp(0, k_cache.shape[1]), ancestors,
                                          depths, scale)
        return out.contiguous(), lse
    return _invariant_kernels().invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale)


lib.impl("invariant_attn", _invariant_attn_cpu, "CPU")
lib.impl("invariant_attn", _invariant_attn_cuda, "CUDA")


def register_reference_cuda_fallbacks() -> None:
    """Back the internal CUDA kernels with the PyTorch references (only when ``_C`` is absent)."""
    lib.impl("_merge_attn_states_kernel", ref.merge_attn_states, "CUDA")
    lib.impl("_commit_kv_kernel", ref.commit_kv_, "CUDA")
