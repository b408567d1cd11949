"""``fused_linear``: a draft level's linear over few rows, with its RMSNorm, SwiGLU and residual add folded in.

A LongSpec draft level runs its block on the level's frontier (1, 4 or 16 rows per batch row), so each linear is a
weight read: at Llama-3-8B shapes cuBLAS picks split-K for so few rows and adds a reduce kernel, and on a small
model every launch is a few microseconds of fixed cost around almost no bytes. ``_fused_linear_kernel`` reads each
weight row once for all (<= 16) rows of x: program ``p`` owns output columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)``,
streams their weight rows over K in ``BLOCK_K`` steps and accumulates in float32 on the tensor cores. With
``LinearConfig.split_k`` > 1, K is split over that many programs per tile, which store float32 partial sums, and
``_split_k_reduce_kernel`` adds them in split order (deterministic, no atomics) and runs the epilogue: more
programs in flight for narrow outputs (4096 columns are 128 programs of 32 rows: one warp per scheduler, where the
float8 conversion's dependent instructions stall), for one more launch. Around the GEMM, under constexpr flags:

* ``HAS_NORM``: x is RMS-normalised first (a first pass over x's rows for the mean square, then each K step is
  normalised as it is loaded), rounding like transformers' ``LlamaRMSNorm``: ``w * (x * rstd).to(x.dtype)``. Only
  for narrow rows (K < :data:`NORM_IN_KERNEL_BELOW`): at real widths both ways of folding the norm in were slower
  than a separate ``longspec::rms_norm`` launch (N1 + q/k/v at Llama-3-8B, 16 rows: 22.6 us with this statistics
  pass, 35.5 us with one pass that scales the accumulator by rstd, against 18.3-18.6 us for the two launches), so
  :func:`fused_linear` launches the norm separately there; at the shipped pair's width (K = 384) the statistics
  pass won, 3.9 us against 4.4;
* ``SWIGLU``: ``weight`` is the packed ``[gate; up]`` projection; the program accumulates gate columns ``n`` and up
  columns ``I + n`` side by side and stores ``silu(gate) * up`` (``I`` columns, not ``2 I``);
* ``HAS_RES``: ``residual + y`` in the epilogue;
* ``HAS_SCALE``: ``weight`` is float8_e4m3fn with one float32 scale per row (weight-only FP8, half the bytes of a
  16-bit weight: a skinny GEMM is a weight read). Each loaded tile is converted to x's dtype (exact: every e4m3
  value is a bfloat16 / float16 value) and the float32 accumulator is scaled per column before the bias, as
  :func:`longspec_ops.reference.linear.fused_linear` defines it.

Every intermediate is rounded to x's dtype where the unfused ops round (bias into the float32 accumulator, then
the activation, the product and the residual add each in x's dtype), so the fused result differs from the
composition (:func:`longspec_ops.reference.linear.fused_linear`) only by the GEMM's accumulation order. A row
never sees another row, and the launch depends on (N, K) only, never on M.

Speed (``python -m benchmarks.probe_skinny_gemm``, H200, bf16, 1-16 rows, weights from HBM; results/h200/NOTES.md,
"fused_linear"): against cuBLAS, 15.5-15.8 us vs 16.1-17.1 for Llama-3-8B's packed q/k/v, 11.4-11.5 vs 13.4-13.6
for a 4096 x 4096 weight, 30.7-31.1 vs 32.1-32.9 for 4096 x 14336, 63.5-64.3 vs 65.7-67.0 for a 32k-row LM head,
57.3-59.0 vs 57.0-57.7 for 28672 x 4096 (gate/up); 2.4-3.2 us vs 2.9-3.7 at the shipped pair's shapes. The
residual in the epilogue: 11.5-11.7 us against 15.1-15.4 for cuBLAS + add at 4096 x 4096, 2.5-2.6 against 4.1-4.2
at the pair; N3 + gate/up + SwiGLU at the pair 4.7 against 9.6 (at Llama-3-8B's width, with its norm launched
separately, not timed). :func:`default_config` is the sweep's best launch per shape.
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
from .launch import _dot_precision

MAX_ROWS = 16  # rows the kernel takes in one launch (one tensor-core tile); more rows take the composed path
NORM_IN_KERNEL_BELOW = 2048  # K from which the norm is its own launch (see HAS_NORM in the module docstring)
_REDUCE_BLOCK_N = 64  # output columns per program of the split-K reduce


@dataclass(frozen=True)
class LinearConfig:
    """One launch of ``_fused_linear_kernel``: output columns per program, K per step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # programs along K per output tile; > 1: float32 partials, then one reduce + epilogue launch

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LinearConfig.{name} must be a power of two >= 16, got {value}")
        if self.split_k < 1:
            raise ValueError(f"LinearConfig.split_k must be >= 1, got {self.split_k}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"LinearConfig.num_warps and num_stages must be >= 1, got {self.num_warps}, "
                             f"{self.num_stages}")


def default_config(n_out: int, k: int, num_sms: int = 132, swiglu: bool = False,
                   weight_bytes: int = 2) -> LinearConfig:
    """The probe's best launches (H200, results/h200/probe_skinny_gemm.json), as a rule of (output columns, K).

    A program reads ``block_n`` weight rows (``2 block_n`` with SwiGLU: gate and up). Wide K (>= 2048, real model
    widths): 64 rows a program when that still gives >= 0.7 programs per SM, else 32 (a 4096-column output: 128
    programs); with more than 1.5 waves of programs (LM heads, gate/up) small tiles (128-element K steps, 3 stages)
    so that two programs share an SM, else one deep pipeline (5 stages, 256-element steps at 32 rows, 128 at 64).
    Narrow K (small models, launch-bound): 16 rows a program for <= 1024 outputs, else 32; 512-element K steps from
    K = 1024, else 128; 3 stages. A 1-byte (float8) weight at wide K (``probe_skinny_gemm --fp8``, H100,
    probe_skinny_gemm_fp8.json): 256-element K steps over 64 rows a program when there are more than 1.5 waves of
    programs (LM head 52.7 us, best 52.1; gate/up + SwiGLU 51.2, best 50.2), else 32 rows in 512-element steps with 4
    stages, the best launch of q/k/v (16.2 us against 20.5 for the 64-row rule), o_proj and down_proj; from K = 8192
    (down_proj) that launch with K split in two (H200: 21.5 us against 25.0; two splits did not help o_proj or
    q/k/v, four were slower, and no split helped a 16-bit weight). From K = 16384 (Qwen2.5-32B's down_proj, K =
    27648, 5120 outputs; ``probe_skinny_gemm --fp8 --shapes 32B --rows 16``, H100,
    results/h100/probe_skinny_gemm_fp8_32B.json): 256-element steps, 3 stages, K split into pieces of at most 8192
    (four there, 640 programs over its 160 column tiles: 53.2 us against 71.6 for two splits of the 512-element
    launch, 61.2 for four; floor 46.7).
    """
    per_row = 2 if swiglu else 1
    if k >= 2048:
        rows = 64 if triton.cdiv(n_out * per_row, 64) >= 0.7 * num_sms else 32
        if triton.cdiv(n_out * per_row, 64) > 1.5 * num_sms:
            return LinearConfig(rows // per_row, 256 if weight_bytes == 1 else 128, 4, 3)
        if weight_bytes == 1 and k >= 16384:
            return LinearConfig(32 // per_row, 256, 4, 3, split_k=triton.cdiv(k, 8192))
        if weight_bytes == 1:
            return LinearConfig(32 // per_row, 512, 4, 4, split_k=2 if k >= 8192 else 1)
        return LinearConfig(rows // per_row, 256 if rows == 32 else 128, 4, 5)
    return LinearConfig(max(16, (16 if n_out <= 1024 else 32) // per_row), 512 if k >= 1024 else 128, 4, 3)


@triton.jit
def _from_fp8(w, dtype: tl.constexpr):
    """A float8_e4m3fn tile in ``dtype``, exactly (every e4m3 value is a normal float16 and a bfloat16). To bfloat16
    through float16 and float32: e4m3 -> f16 is one packed instruction a pair, f16 -> f32 runs on the FMA pipe and
    f32 -> bf16 packs a pair, while Triton 3.6's direct conversion on sm_90 goes e4m3 -> f16 and then f16 -> bf16
    one element at a time on the conversion unit (F2F: 128 per thread and 512-element K step at 32 rows a
    program). On an H200 at M = 16 (``probe_skinny_gemm --fp8``, 2026-12-05): gate/up 48.9 -> 34.6 us, the 32k head
    48.6 -> 36.1, down 32.3 -> 25.0, q/k/v 16.1 -> 13.1, o_proj 12.1 -> 10.4. Byte moves + a packed bf16 multiply
    by 2^120 (CUTLASS's trick, inline PTX) measured 2-9% slower than this and were dropped."""
    if dtype == tl.bfloat16:
        return w.to(tl.float16).to(tl.float32).to(tl.bfloat16)
    return w.to(dtype)


@triton.jit(do_not_specialize=["M"])
def _fused_linear_kernel(
    X,  # (M, K), stride(-1) == 1
    W,  # (N, K), stride(-1) == 1; with SWIGLU rows [0, N_OUT) gate and [N_OUT, 2 N_OUT) up
    SCALE,  # (N,) float32 per-row scales of a float8 W   [HAS_SCALE]
    BIAS,  # (N,)                    [HAS_BIAS]
    G,  # (K,) RMSNorm weight       [HAS_NORM]
    RES,  # (M, N_OUT), stride(-1) == 1  [HAS_RES]
    Y,  # (M, N_OUT) contiguous, X's dtype
    WS,  # (SPLIT, BLOCK_M, N) float32 partial sums, gate columns then up columns with SWIGLU   [SPLIT > 1]
    M, N_OUT, K, k_per,  # k_per: K per split, a multiple of BLOCK_K
    stride_xm, stride_wn, stride_rm,
    eps,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr,
    HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N_OUT
    x_rows = X + rm[:, None] * stride_xm

    if HAS_NORM:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + offs_k
            xs = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, 1)
        rstd = tl.rsqrt(ss / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = acc  # the up columns' sums (SWIGLU only)
    k_lo = tl.program_id(1) * k_per
    for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BLOCK_K):
        rk = k0 + offs_k
        if EVEN_K:  # K a multiple of BLOCK_K (real model widths): the masks are loop-invariant, no per-step compares
            x_mask = m_ok[:, None]
            w_mask = n_ok[:, None]
        else:
            k_ok = rk < K
            x_mask = m_ok[:, None] & k_ok[None, :]
            w_mask = n_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + rk[None, :], mask=x_mask, other=0.0)
        if HAS_NORM:
            if EVEN_K:
                g = tl.load(G + rk).to(tl.float32)
            else:
                g = tl.load(G + rk, mask=k_ok, other=0.0).to(tl.float32)
            xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)  # LlamaRMSNorm rounds here ...
            x = (g[None, :] * xn.to(tl.float32)).to(x.dtype)  # ... and after the weight
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=w_mask, other=0.0)
        if HAS_SCALE:
            w = _from_fp8(w, x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            wu = tl.load(W + (rn + N_OUT)[:, None] * stride_wn + rk[None, :], mask=w_mask, other=0.0)
            if HAS_SCALE:
                wu = _from_fp8(wu, x.dtype)
            acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PRECISION)

    if SPLIT > 1:
        ws_mask = m_ok[:, None] & n_ok[None, :]
        ws = WS + tl.program_id(1) * BLOCK_M * N_OUT * (2 if SWIGLU else 1) + rm[:, None] * N_OUT * (2 if SWIGLU else 1)
        tl.store(ws + rn[None, :], acc, mask=ws_mask)
        if SWIGLU:
            tl.store(ws + (N_OUT + rn)[None, :], acc_up, mask=ws_mask)
    else:
        _epilogue(acc, acc_up, rm, rn, m_ok, n_ok, SCALE, BIAS, RES, Y, N_OUT, stride_rm,
                  HAS_BIAS, HAS_RES, SWIGLU, HAS_SCALE)


@triton.jit
def _epilogue(acc, acc_up, rm, rn, m_ok, n_ok, SCALE, BIAS, RES, Y, N_OUT, stride_rm,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_SCALE: tl.constexpr):
    """The float32 sums of a [BLOCK_M, BLOCK_N] output tile -> Y: per-column float8 scale, bias, SwiGLU,
    residual, each rounded where the unfused ops round."""
    DT = Y.dtype.element_ty
    if HAS_SCALE:
        acc *= tl.load(SCALE + rn, mask=n_ok, other=0.0)[None, :]
        if SWIGLU:
            acc_up *= tl.load(SCALE + N_OUT + rn, mask=n_ok, other=0.0)[None, :]
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


@triton.jit
def _split_k_reduce_kernel(
    WS, SCALE, BIAS, RES, Y,  # as in _fused_linear_kernel
    M, N_OUT, stride_rm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_SCALE: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Sum the SPLIT partial tiles in split order (deterministic: no atomics), then the epilogue."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N_OUT
    width = N_OUT * (2 if SWIGLU else 1)
    mask = m_ok[:, None] & n_ok[None, :]
    ws = WS + rm[:, None] * width + rn[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = acc
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws + s * BLOCK_M * width, mask=mask, other=0.0)
        if SWIGLU:
            acc_up += tl.load(ws + s * BLOCK_M * width + N_OUT, mask=mask, other=0.0)
    _epilogue(acc, acc_up, rm, rn, m_ok, n_ok, SCALE, BIAS, RES, Y, N_OUT, stride_rm,
              HAS_BIAS, HAS_RES, SWIGLU, HAS_SCALE)


def _rows(t: Tensor, width: int) -> Tensor:
    """``t`` [..., width] as a 2-D [rows, width] tensor with a contiguous last dim (a view when possible)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 or width <= 1 else t2.contiguous()


def fused_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                 residual: Optional[Tensor], swiglu: bool, weight_scale: Optional[Tensor] = None,
                 config: Optional[LinearConfig] = None) -> Tensor:
    """One launch of ``_fused_linear_kernel`` for already-validated arguments with at most :data:`MAX_ROWS` rows
    (``longspec_ops._checks.check_fused_linear``). ``config`` overrides :func:`default_config` (sweeps, tests)."""
    K, N = x.shape[-1], weight.shape[0]
    n_out = N // 2 if swiglu else N
    x2 = _rows(x, K)
    M = x2.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"fused_linear kernel: at most {MAX_ROWS} rows per launch, got {M}")
    if norm_weight is not None and K >= NORM_IN_KERNEL_BELOW:
        x2, norm_weight = torch.ops.longspec.rms_norm(x2, norm_weight, float(eps)), None
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if M > 0 and n_out > 0:
        res2 = _rows(residual, n_out) if residual is not None else out
        # the kernel indexes the vectors with unit stride (the checks allow any strides)
        bias = bias.contiguous() if bias is not None else None
        norm_weight = norm_weight.contiguous() if norm_weight is not None else None
        if config is None:
            config = default_config(n_out, K, _num_sms(x.device), bool(swiglu), weight.element_size())
        scale = weight_scale.contiguous() if weight_scale is not None else x2
        bias_arg = bias if bias is not None else x2
        # K per split in whole BLOCK_K steps; the splits actually used (a tiny K may need fewer)
        k_per = triton.cdiv(triton.cdiv(K, config.split_k), config.block_k) * config.block_k
        split = triton.cdiv(K, k_per)
        ws = (torch.empty((split, MAX_ROWS, N), dtype=torch.float32, device=x.device) if split > 1 else x2)
        n_tiles = triton.cdiv(n_out, config.block_n)
        flags = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, SWIGLU=bool(swiglu),
                     HAS_SCALE=weight_scale is not None)
        _fused_linear_kernel[(n_tiles, split)](
            x2, weight, scale, bias_arg, norm_weight if norm_weight is not None else x2,
            res2, out, ws,
            M, n_out, K, k_per, x2.stride(0), weight.stride(0), res2.stride(0), float(eps),
            HAS_NORM=norm_weight is not None, **flags,
            EVEN_K=K % config.block_k == 0, SPLIT=split,
            BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            DOT_PRECISION=_dot_precision(x.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if split > 1:
            _split_k_reduce_kernel[(triton.cdiv(n_out, _REDUCE_BLOCK_N),)](
                ws, scale, bias_arg, res2, out, M, n_out, res2.stride(0), **flags,
                SPLIT=split, BLOCK_M=MAX_ROWS, BLOCK_N=_REDUCE_BLOCK_N, num_warps=4,
            )
    return out.view(*x.shape[:-1], n_out)


def composed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                    residual: Optional[Tensor], swiglu: bool, weight_scale: Optional[Tensor] = None) -> Tensor:
    """The CUDA path above :data:`MAX_ROWS` rows (a batch of frontiers, the draft's prefill of its window): the norm
    as one ``longspec::rms_norm`` launch, then the reference's cuBLAS GEMM and elementwise ops (a float8 weight is
    dequantized by the reference: correct, not fast; the draft's committed-token K/V stay on the 16-bit weights)."""
    if norm_weight is not None:
        x = torch.ops.longspec.rms_norm(x, norm_weight, float(eps))
    return _ref.fused_linear(x, weight, bias, None, eps, residual, swiglu, weight_scale)


__all__ = ["LinearConfig", "MAX_ROWS", "NORM_IN_KERNEL_BELOW", "composed_linear", "default_config", "fused_linear"]
