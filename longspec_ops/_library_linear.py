"""The linear and norm ops of the ``longspec`` library (:mod:`._library` holds the rest, and the ``Library``).

* ``invariant_linear`` / ``rms_norm`` (``longspec.decode.Numerics.INVARIANT``): a row's result does not depend on how
  many rows the call holds (:mod:`longspec_ops.kernels.invariant`): the target's forwards use them so that a token's
  logits in a verify forward equal plain decoding's bit for bit.
* ``fused_linear``: a draft level's linear with its RMSNorm / SwiGLU / residual folded in
  (:mod:`longspec_ops.kernels.linear`).

Each has its schema, its fake kernel, its CPU kernel (the reference) and its CUDA kernel, as in :mod:`._library`.
"""
from __future__ import annotations

import torch

from . import _checks
from ._library import _invariant_kernels, lib
from .reference import invariant as inv_ref
from .reference import linear as linear_ref

# invariant_linear, rms_norm ------------------------------------------------------------------------------------
lib.define("invariant_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


@torch.library.register_fake("longspec::invariant_linear", lib=lib)
def _invariant_linear_fake(x, weight, bias):
    _checks.check_invariant_linear(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _invariant_linear_cpu(x, weight, bias):
    _checks.check_invariant_linear(x, weight, bias)
    return inv_ref.invariant_linear(x, weight, bias)


def _invariant_linear_cuda(x, weight, bias):
    _checks.check_invariant_linear(x, weight, bias)
    if x.dtype == torch.float64:
        return inv_ref.invariant_linear(x, weight, bias)
    return _invariant_kernels().invariant_linear(x, weight, bias)


lib.impl("invariant_linear", _invariant_linear_cpu, "CPU")
lib.impl("invariant_linear", _invariant_linear_cuda, "CUDA")

lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")


@torch.library.register_fake("longspec::rms_norm", lib=lib)
def _rms_norm_fake(x, weight, eps):
    _checks.check_rms_norm(x, weight, eps)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _rms_norm_cpu(x, weight, eps):
    _checks.check_rms_norm(x, weight, eps)
    return inv_ref.rms_norm(x, weight, eps)


def _rms_norm_cuda(x, weight, eps):
    _checks.check_rms_norm(x, weight, eps)
    if x.dtype == torch.float64:
        return inv_ref.rms_norm(x, weight, eps)
    return _invariant_kernels().rms_norm(x, weight, eps)


lib.impl("rms_norm", _rms_norm_cpu, "CPU")
lib.impl("rms_norm", _rms_norm_cuda, "CUDA")

# fused_linear: a draft level's linear with its RMSNorm / SwiGLU / residual folded in (kernels/linear.py) ---------
lib.define("fused_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight, float eps, Tensor? residual, "
           "bool swiglu, Tensor? weight_scale=None) -> Tensor")


@torch.library.register_fake("longspec::fused_linear", lib=lib)
def _fused_linear_fake(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale=None):
    _checks.check_fused_linear(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale)
    N = weight.shape[0]
    return x.new_empty((*x.shape[:-1], N // 2 if swiglu else N))


def _fused_linear_cpu(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale=None):
    _checks.check_fused_linear(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale)
    return linear_ref.fused_linear(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale)


def _fused_linear_cuda(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale=None):
    _checks.check_fused_linear(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale)
    from .kernels import linear

    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.dtype == torch.float64 or rows > linear.MAX_ROWS or x.shape[-1] == 0:
        return linear.composed_linear(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale)
    return linear.fused_linear(x, weight, bias, norm_weight, eps, residual, swiglu, weight_scale)


lib.impl("fused_linear", _fused_linear_cpu, "CPU")
lib.impl("fused_linear", _fused_linear_cuda, "CUDA")
