"""``fused_linear``: a draft level's linear over few rows, with its RMSNorm, SwiGLU and residual add folded in.

A LongSpec draft level runs its block on the level's frontier (1, 4 or 16 rows per batch row), so each linear is a
weight read: at Llama-3-8B shapes cuBLAS picks split-K for so few rows and adds a reduce kernel, and on a small
model every launch is a few microseconds of fixed cost around almost no bytes. ``_fused_linear_kernel`` reads each
weight row once for all (<= 16) rows of x: program ``p`` owns output columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)``,
streams their weight rows over K in ``BLOCK_K`` steps (no split of K, so no second kernel) and accumulates in
float32 on the tensor cores. Around the GEMM, under constexpr flags:

* ``HAS_NORM``: x is RMS-normalised first, in the same pass: each K step multiplies x by the norm's weight as it
  is loaded (rounded to x's dtype for the tensor cores) and adds to the rows' mean square, and the accumulator is
  scaled by ``rstd`` at the end (``norm(x) W^T = rstd * ((x * g) W^T)``). A statistics pass before the GEMM cost
  4-17 us a launch at Llama-3-8B widths (the weight stream waited for it);
* ``SWIGLU``: ``weight`` is the packed ``[gate; up]`` projection; the program accumulates gate columns ``n`` and up
  columns ``I + n`` side by side and stores ``silu(gate) * up`` (``I`` columns, not ``2 I``);
* ``HAS_RES``: ``residual + y`` in the epilogue.

After the GEMM every intermediate is rounded to x's dtype where the unfused ops round (bias into the float32
accumulator, then the activation, the product and the residual add each in x's dtype). The fused result differs
from the composition (:func:`longspec_ops.reference.linear.fused_linear`) by the GEMM's accumulation order and,
with the norm, by where the normalised input is rounded (``x * g`` here, ``x * rstd`` and then ``g *`` that in
``LlamaRMSNorm``): rounding-level differences, held to the flash-attention tolerance rule by the tests. A row never
sees another row, and the launch depends on (N, K) only, never on M.

Speed (``python -m benchmarks.probe_skinny_gemm``, H200, bf16, weights from HBM; results/h200/NOTES.md): against
cuBLAS at 1-16 rows, 11.1-11.3 us vs 13.3-13.5 for a 4096 x 4096 weight, 30.5-30.9 vs 32.6-33.3 for 4096 x 14336,
63.5-64.9 vs 66.4-67.6 for a 32k-row LM head, equal for 28672 x 4096; 2.3-3.1 us vs 2.9-3.9 at the shipped
pair's shapes (hidden 384). The table in :func:`default_config` comes from that probe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import linear as _ref
from .configs import _num_sms

MAX_ROWS = 16  # rows the kernel takes in one launch (one tensor-core tile); more rows take the composed path


@dataclass(frozen=True)
class LinearConfig:
    """One launch of ``_fused_linear_kernel``: output columns per program, K per step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"LinearConfig.num_warps and num_stages must be >= 1, got {self.num_warps}, "
                             f"{self.num_stages}")


def default_config(n_out: int, k: int, num_sms: int = 132, swiglu: bool = False) -> LinearConfig:
    """The probe's best launches (H200, results/h200/probe_skinny_gemm.json), as a rule of (output columns, K).

    A program reads ``block_n`` weight rows (``2 block_n`` with SwiGLU: gate and up). Wide K (>= 2048, real model
    widths): 64 rows a program when that still gives >= 0.7 programs per SM, else 32 (a 4096-column output: 128
    programs); with more than 1.5 waves of programs (LM heads, gate/up) small tiles (128-element K steps, 3 stages)
    so that two programs share an SM, else one deep pipeline (5 stages, 256-element steps at 32 rows, 128 at 64).
    Narrow K (small models, launch-bound): 16 rows a program for <= 1024 outputs, else 32; 512-element K steps from
    K = 1024, else 128; 3 stages.
    """
    per_row = 2 if swiglu else 1
    if k >= 2048:
        rows = 64 if triton.cdiv(n_out * per_row, 64) >= 0.7 * num_sms else 32
        if triton.cdiv(n_out * per_row, 64) > 1.5 * num_sms:
            return LinearConfig(rows // per_row, 128, 4, 3)
        return LinearConfig(rows // per_row, 256 if rows == 32 else 128, 4, 5)
    return LinearConfig(max(16, (16 if n_out <= 1024 else 32) // per_row), 512 if k >= 1024 else 128, 4, 3)


@triton.jit(do_not_specialize=["M"])
def _fused_linear_kernel(
    X,  # (M, K), stride(-1) == 1
    W,  # (N, K), stride(-1) == 1; with SWIGLU rows [0, N_OUT) gate and [N_OUT, 2 N_OUT) up
    BIAS,  # (N,)                    [HAS_BIAS]
    G,  # (K,) RMSNorm weight       [HAS_NORM]
    RES,  # (M, N_OUT), stride(-1) == 1  [HAS_RES]
    Y,  # (M, N_OUT) contiguous, X's dtype
    M, N_OUT, K,
    stride_xm, stride_wn, stride_rm,
    eps,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N_OUT
    x_rows = X + rm[:, None] * stride_xm

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if HAS_NORM:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + offs_k
        k_ok = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:
            # norm(x) W^T = rstd * ((x * g) W^T): the mean square accumulates in the same pass over x, and rstd
            # scales the accumulator at the end (one pass, the weight stream never waits for a statistics pass)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            x = (xf * tl.load(G + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            wu = tl.load(W + (rn + N_OUT)[:, None] * stride_wn + rk[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PRECISION)

    DT = Y.dtype.element_ty
    if HAS_NORM:
        rstd = tl.rsqrt(ss / K + eps)
        acc = acc * rstd[:, None]
        if SWIGLU:
            acc_up = acc_up * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(DT)
    if SWIGLU:
        if HAS_BIAS:
            acc_up += tl.load(BIAS + N_OUT + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DT)  # F.silu: x / (1 + e^-x) in float32, rounded
        y = (act.to(tl.float32) * acc_up.to(DT).to(tl.float32)).to(DT)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        r = tl.load(RES + rm[:, None] * stride_rm + rn[None, :], mask=out_mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(DT)
    tl.store(Y + rm[:, None] * N_OUT + rn[None, :], y, mask=out_mask)


def _rows(t: Tensor, width: int) -> Tensor:
    """``t`` [..., width] as a 2-D [rows, width] tensor with a contiguous last dim (a view when possible)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 or width <= 1 else t2.contiguous()


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                 residual: Optional[Tensor], swiglu: bool, config: Optional[LinearConfig] = None) -> Tensor:
    """One launch of ``_fused_linear_kernel`` for already-validated arguments with at most :data:`MAX_ROWS` rows
    (``longspec_ops._checks.check_fused_linear``). ``config`` overrides :func:`default_config` (sweeps, tests)."""
    K, N = x.shape[-1], weight.shape[0]
    n_out = N // 2 if swiglu else N
    x2 = _rows(x, K)
    M = x2.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"fused_linear kernel: at most {MAX_ROWS} rows per launch, got {M}")
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if M > 0 and n_out > 0:
        res2 = _rows(residual, n_out) if residual is not None else out
        if config is None:
            config = default_config(n_out, K, _num_sms(x.device), bool(swiglu))
        _fused_linear_kernel[(triton.cdiv(n_out, config.block_n),)](
            x2, weight, bias if bias is not None else x2, norm_weight if norm_weight is not None else x2, res2, out,
            M, n_out, K, x2.stride(0), weight.stride(0), res2.stride(0), float(eps),
            HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RES=residual is not None,
            SWIGLU=bool(swiglu), BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out.view(*x.shape[:-1], n_out)


def composed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                    residual: Optional[Tensor], swiglu: bool) -> Tensor:
    """The CUDA path above :data:`MAX_ROWS` rows (a batch of frontiers, the draft's window refeed): the norm as one
    ``longspec::rms_norm`` launch, then the reference's cuBLAS GEMM and elementwise ops."""
    if norm_weight is not None:
        x = torch.ops.longspec.rms_norm(x, norm_weight, float(eps))
    return _ref.fused_linear(x, weight, bias, None, eps, residual, swiglu)


__all__ = ["LinearConfig", "MAX_ROWS", "composed_linear", "default_config", "fused_linear"]
