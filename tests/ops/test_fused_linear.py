"""``longspec::fused_linear`` (``longspec_ops.kernels.linear``): the kernel against its reference under the
flash-attention tolerance rule, the op's CPU path against the draft block's unfused modules bit for bit, row
independence, and bad input. Without a GPU the kernel runs under the Triton interpreter (float16 / float32)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

import longspec_ops  # noqa: E402,F401
from longspec_ops.kernels.linear import (MAX_ROWS, NORM_IN_KERNEL_BELOW, LinearConfig, default_config,  # noqa: E402
                                         fused_linear)
from longspec_ops.reference import linear as ref  # noqa: E402

from .test_invariant_kernels import _row_local_dot  # noqa: E402,F401
from .test_triton_kernels import DEVICE, DTYPES, INTERPRET, _interpreter_loop_bounds  # noqa: E402,F401

SMALL = LinearConfig(block_n=16, block_k=16, num_warps=1, num_stages=1)  # many programs and K steps at toy sizes
SPLIT = LinearConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, split_k=3)  # K = 72: 32 + 32 + 8 keys
FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}  # where the same-precision reference is exact
# (bias, norm, residual, swiglu): each fusion alone, all together, none
FLAGS = [(False, False, False, False), (True, False, False, False), (False, True, False, False),
         (False, False, True, False), (False, False, False, True), (True, True, True, True)]
FLAG_IDS = ["plain", "bias", "norm", "residual", "swiglu", "all"]


def _rand(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def _args(M, N, K, dtype, flags, lead=()):
    bias, norm, residual, swiglu = flags
    n_out = N // 2 if swiglu else N
    x = _rand(*lead, M, K, dtype=dtype, seed=0)
    w = _rand(N, K, dtype=dtype, seed=1, scale=K ** -0.5)
    return (x, w, _rand(N, dtype=dtype, seed=2) if bias else None,
            (1.0 + _rand(K, dtype=dtype, seed=3, scale=0.1)) if norm else None, 1e-6,
            _rand(*lead, M, n_out, dtype=dtype, seed=4) if residual else None, swiglu)


def _up(args):
    return [a.double() if torch.is_tensor(a) else a for a in args]


@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("config", [None, SMALL, SPLIT], ids=["table", "small", "split"])
@pytest.mark.parametrize("M", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_within_twice_the_references_error(dtype, M, config, flags):
    """err(kernel, float64) <= 2 err(same-precision reference, float64) + a floor, with N and K ragged against
    the tiles (48 / 2 x 24 outputs, 72 inputs)."""
    args = _args(M, 48, 72, dtype, flags)
    got = fused_linear(*args, config=config)
    want = ref.fused_linear(*_up(args))
    same = ref.fused_linear(*args)
    assert got.shape == want.shape == (M, 24 if flags[3] else 48) and got.dtype == dtype
    err = (got.double() - want).abs().max().item()
    ref_err = (same.double() - want).abs().max().item()
    assert err <= 2 * ref_err + FLOOR[dtype], f"error {err:.3g} vs reference error {ref_err:.3g}"


def test_wide_rows_normalise_in_their_own_launch():
    """From K = NORM_IN_KERNEL_BELOW the norm is a longspec::rms_norm launch before the kernel: same tolerance."""
    args = _args(3, 32, NORM_IN_KERNEL_BELOW, torch.float32, (True, True, True, True))
    got = fused_linear(*args, config=LinearConfig(16, 256, 4, 1))
    want = ref.fused_linear(*_up(args))
    err = (got.double() - want).abs().max().item()
    ref_err = (ref.fused_linear(*args).double() - want).abs().max().item()
    assert err <= 2 * ref_err + FLOOR[torch.float32], (err, ref_err)


def test_strided_bias_and_norm_weight():
    """Vectors with a stride (views of wider tensors) give the same result as their contiguous copies."""
    args = list(_args(4, 24, 32, torch.float32, (True, True, False, False)))
    wide_b, wide_g = _rand(48, dtype=torch.float32, seed=7), 1.0 + _rand(64, dtype=torch.float32, seed=8, scale=0.1)
    args[2], args[3] = wide_b[::2], wide_g[::2]
    want = ref.fused_linear(*args)
    torch.testing.assert_close(fused_linear(*args, config=SMALL), want, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_strided_residual():
    """[B, S, K] inputs keep their leading dims; a residual that is a column slice (last dim contiguous) works."""
    args = list(_args(3, 40, 32, torch.float32, (True, True, False, False), lead=(2,)))
    wide = _rand(2, 3, 80, dtype=torch.float32, seed=9)
    args[5] = wide[..., :40]
    got = fused_linear(*args)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, ref.fused_linear(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("_row_local_dot")
@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
def test_a_row_alone_equals_the_row_in_a_full_call(swiglu):
    """The launch depends on (N, K) only and no row sees another: row i computed alone is bitwise row i of a
    16-row call (the interpreter's dot is made row-local, as tensor cores are)."""
    dtype = torch.float16
    args = _args(MAX_ROWS, 64, 96, dtype, (True, True, True, swiglu))
    full = fused_linear(*args)
    for i in (0, 7, MAX_ROWS - 1):
        alone = list(args)
        alone[0] = args[0][i:i + 1]
        alone[5] = args[5][i:i + 1]
        assert torch.equal(fused_linear(*alone), full[i:i + 1])


def test_cpu_op_is_the_draft_blocks_unfused_modules_bit_for_bit():
    """On the CPU the op is the composition drafting used before: LlamaRMSNorm, nn.Linear, F.silu(gate) * up and
    the residual add give the same bits, in bfloat16 and float32."""
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(2, 3, 64, generator=g).to(dtype)
        h = torch.randn(2, 3, 48, generator=g).to(dtype)
        norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
        norm.weight.data = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
        lin = torch.nn.Linear(64, 96, bias=True).to(dtype)
        got = torch.ops.longspec.fused_linear(x, lin.weight, lin.bias, norm.weight, 1e-5, h, True)
        gate, up = lin(norm(x)).chunk(2, dim=-1)
        assert torch.equal(got, h + F.silu(gate) * up)


def test_default_config_rule():
    """The probe's table: 64 columns a program where that still fills 0.7 of the SMs at real widths, else 32;
    narrow K (small models) 16 or 32 columns in 128-wide steps."""
    assert default_config(6144, 4096, 132) == LinearConfig(64, 128, 4, 5)  # q/k/v: 96 programs
    assert default_config(4096, 4096, 132) == LinearConfig(32, 256, 4, 5)  # o_proj: 128 programs
    assert default_config(4096, 14336, 132) == LinearConfig(32, 256, 4, 5)  # down_proj
    assert default_config(32768, 4096, 132) == LinearConfig(64, 128, 4, 3)  # a 32k LM head: 512 programs
    assert default_config(14336, 4096, 132, swiglu=True) == LinearConfig(32, 128, 4, 3)  # gate/up: 2 x 32 rows
    assert default_config(640, 384, 132) == LinearConfig(16, 128, 4, 3)
    assert default_config(2048, 384, 132) == LinearConfig(32, 128, 4, 3)
    assert default_config(384, 1024, 132) == LinearConfig(16, 512, 4, 3)
    assert default_config(1024, 384, 132, swiglu=True) == LinearConfig(16, 128, 4, 3)
    for n, k, swiglu in ((6144, 4096, False), (4096, 14336, False), (14336, 4096, True), (128256, 4096, False)):
        c = default_config(n, k, 132, swiglu)  # shared memory per program (x + weight tiles, 16-bit) fits sm_90's
        assert c.num_stages * (16 + (2 if swiglu else 1) * c.block_n) * c.block_k * 2 <= 227 * 1024, (n, k)
    assert default_config(6144, 4096, 132, weight_bytes=1) == LinearConfig(32, 512, 4, 4)  # float8 q/k/v
    assert default_config(4096, 14336, 132, weight_bytes=1) == LinearConfig(32, 512, 4, 4, split_k=2)  # float8 down
    assert default_config(5120, 27648, 132, weight_bytes=1) == LinearConfig(32, 256, 4, 3, split_k=4)  # Qwen 32B's
    assert default_config(32768, 4096, 132, weight_bytes=1) == LinearConfig(64, 256, 4, 3)  # float8 LM head
    for n, k, swiglu in ((6144, 4096, False), (4096, 14336, False), (14336, 4096, True), (128256, 4096, False),
                         (5120, 27648, False)):
        c = default_config(n, k, 132, swiglu, weight_bytes=1)  # float8 weight tiles + their 16-bit conversion
        tiles = (2 if swiglu else 1) * c.block_n * c.block_k
        assert c.num_stages * (16 * c.block_k * 2 + tiles) + tiles * 2 <= 227 * 1024, (n, k)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        LinearConfig(block_n=24, block_k=64)


def _fp8_args(M, N, K, dtype, flags):
    args = list(_args(M, N, K, dtype, flags))
    w8, scale = ref.quantize_fp8_rows(args[1].float())
    args[1] = w8.to(DEVICE)
    return args, scale.to(DEVICE)


@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("config", [None, SMALL, SPLIT], ids=["table", "small", "split"])
@pytest.mark.parametrize("M", [1, MAX_ROWS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_weight_within_twice_the_references_error(dtype, M, config, flags):
    """A float8_e4m3fn weight with per-row scales: the kernel against the float64 dequantized composition, under
    the same tolerance rule as the 16-bit weights (the quantization itself is the op's input, not its error)."""
    args, scale = _fp8_args(M, 48, 72, dtype, flags)
    got = fused_linear(*args, weight_scale=scale, config=config)
    want = ref.fused_linear(*_up(args[:1]), args[1], *_up(args[2:]), weight_scale=scale)
    same = ref.fused_linear(*args, weight_scale=scale)
    assert got.shape == want.shape == (M, 24 if flags[3] else 48) and got.dtype == dtype
    err = (got.double() - want).abs().max().item()
    ref_err = (same.double() - want).abs().max().item()
    assert err <= 2 * ref_err + FLOOR[dtype], f"error {err:.3g} vs reference error {ref_err:.3g}"


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
def test_every_fp8_code_converts_exactly(dtype):
    """Every e4m3 code (NaNs aside; subnormals, both zeros, +-448 included) comes out of the kernel's float8 ->
    16-bit conversion as its exact value: one-hot rows read single weights through the GEMM, whose one nonzero
    product per output is exact. (bfloat16 runs on the GPU only: the interpreter's bfloat16 dot is wrong.)"""
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    w8 = codes.to(torch.uint8).view(torch.float8_e4m3fn).view(16, 16)  # w8[n, k] = code 16 n + k
    x = torch.eye(16, dtype=dtype)  # row m reads column m of every weight row
    got = fused_linear(x.to(DEVICE), w8.to(DEVICE), None, None, 0.0, None, False,
                       weight_scale=torch.ones(16, device=DEVICE), config=SMALL)
    assert torch.equal(got.cpu(), w8.float().T.to(dtype))


def test_fp8_reference_is_the_dequantized_linear():
    """The CPU op with a float8 weight is ``x @ (w8 * scale)^T + bias`` in float32, rounded once to x's dtype."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 64, generator=g) * 0.1
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    w8, scale = ref.quantize_fp8_rows(w)
    got = torch.ops.longspec.fused_linear(x, w8, b, None, 0.0, None, False, scale)
    want = (x.float() @ (w8.float() * scale[:, None]).T + b.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_quantize_fp8_rows_error_and_zero_rows():
    """Each row's largest magnitude maps to 448; the round trip is within half an e4m3 step (3 mantissa bits:
    2^-4 relative for normal values, 2^-10 of the scale below 2^-6); an all-zero row gets scale 1 and stays 0."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(16, 256, generator=g) * torch.logspace(-3, 2, 16)[:, None]
    w[3] = 0.0
    w8, scale = ref.quantize_fp8_rows(w.to(torch.bfloat16))
    assert w8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (16,)
    assert scale[3] == 1.0 and not w8[3].float().any()
    back = w8.float() * scale[:, None]
    bound = torch.maximum(back.abs() * 2 ** -4, scale[:, None] * 2 ** -10)
    assert ((back - w.to(torch.bfloat16).float()).abs() <= bound * 1.0001 + 1e-12).all()
    assert torch.allclose(w8.float().abs().amax(1)[torch.arange(16) != 3], torch.tensor(448.0))
    with pytest.raises(ValueError, match="weight must be a floating-point \\[N, K\\] tensor"):
        ref.quantize_fp8_rows(torch.zeros(4, dtype=torch.float32))


def test_the_kernel_refuses_more_rows_than_one_tile():
    x, w = torch.zeros(MAX_ROWS + 1, 16), torch.zeros(16, 16)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        fused_linear(x, w, None, None, 0.0, None, False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight=torch.zeros(8, 5)), "weight must be \\[N, K\\] with K = x's last dimension \\(4\\)"),
    (dict(weight=torch.zeros(8, 4, dtype=torch.float16)), "weight must have x's dtype"),
    (dict(bias=torch.zeros(7)), "bias must be torch.float32 \\[8\\]"),
    (dict(norm_weight=torch.zeros(5)), "norm_weight must be torch.float32 \\[4\\]"),
    (dict(norm_weight=torch.ones(4), eps=-1.0), "eps must be a finite float >= 0"),
    (dict(weight=torch.zeros(7, 4), swiglu=True), "swiglu needs weight = \\[gate; up\\] with an even row count"),
    (dict(residual=torch.zeros(3, 5)), "residual must be torch.float32 \\(3, 8\\)"),
    (dict(residual=torch.zeros(3, 8), swiglu=True), "residual must be torch.float32 \\(3, 4\\)"),
    (dict(x=torch.zeros(3, 4, dtype=torch.int32)), "x must be float16, bfloat16, float32 or float64"),
    (dict(weight=torch.zeros(8, 4, dtype=torch.float8_e4m3fn)), "or be float8_e4m3fn with a weight_scale"),
    (dict(weight_scale=torch.ones(8)), "weight must be float8_e4m3fn when weight_scale is given"),
    (dict(weight=torch.zeros(8, 4, dtype=torch.float8_e4m3fn), weight_scale=torch.ones(4)),
     "weight_scale must be float32 \\[8\\]"),
    (dict(weight=torch.zeros(8, 4, dtype=torch.float8_e4m3fn), weight_scale=torch.ones(8, dtype=torch.float16)),
     "weight_scale must be float32 \\[8\\]"),
])
def test_bad_input_names_the_argument(kwargs, match):
    args = dict(x=torch.zeros(3, 4), weight=torch.zeros(8, 4), bias=None, norm_weight=None, eps=1e-6,
                residual=None, swiglu=False, weight_scale=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        torch.ops.longspec.fused_linear(**args)


@pytest.mark.requires_cuda
@pytest.mark.skipif(INTERPRET, reason="the CUDA dispatch")
def test_cuda_op_takes_the_kernel_up_to_16_rows_and_cublas_above():
    """bf16 at Llama-3-8B's draft widths: the op within the tolerance rule of the float64 composition with 16 rows
    (the kernel, default table) and with 48 rows (the composed path: longspec::rms_norm, cuBLAS)."""
    for M in (1, MAX_ROWS, 48):
        for flags in ((True, True, False, False), (False, True, False, True), (False, False, True, False)):
            args = _args(M, 2 * 1024 if flags[3] else 1024, 4096, torch.bfloat16, flags)
            got = torch.ops.longspec.fused_linear(*args)
            want = ref.fused_linear(*_up(args))
            err = (got.double() - want).abs().max().item()
            ref_err = (ref.fused_linear(*args).double() - want).abs().max().item()
            assert err <= 2 * ref_err + FLOOR[torch.bfloat16], (M, flags, err, ref_err)
            args, scale = _fp8_args(M, 2 * 1024 if flags[3] else 1024, 4096, torch.bfloat16, flags)
            got = torch.ops.longspec.fused_linear(*args, scale)
            want = ref.fused_linear(*_up(args[:1]), args[1], *_up(args[2:]), weight_scale=scale)
            err = (got.double() - want).abs().max().item()
            ref_err = (ref.fused_linear(*args, weight_scale=scale).double() - want).abs().max().item()
            assert err <= 2 * ref_err + FLOOR[torch.bfloat16], ("fp8", M, flags, err, ref_err)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_opcheck_fp8_weight(device):
    """The op's schema, fake kernel and autograd registration with a float8 weight and its row scales."""
    g = torch.Generator().manual_seed(13)
    w8, scale = ref.quantize_fp8_rows(torch.randn(64, 96, generator=g) * 0.1)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    args = (torch.randn(2, 3, 96, generator=g).to(device, dt), w8.to(device), None,
            (1 + 0.1 * torch.randn(96, generator=g)).to(device, dt), 1e-6,
            torch.randn(2, 3, 32, generator=g).to(device, dt), True, scale.to(device))
    # test_schema is left out: its mutation check multiplies every input, which PyTorch's float8 CPU tensors do
    # not implement ("mul_cpu_reduced_float" for Float8_e4m3fn); the 16-bit cases run it (test_reference.py)
    torch.library.opcheck(torch.ops.longspec.fused_linear, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
