"""The C++/CUDA extension ``longspec_ops._C``: it is built and loaded on CUDA machines, and its kernels for
``merge_attn_states`` and ``commit_kv_`` match the PyTorch references in :mod:`longspec_ops.reference.attention`.

Every test needs a GPU (``requires_cuda``): without one they are collected and skipped. The kernels under test
are the C++ ones because ``_C`` registers them for the CUDA dispatch key; ``test_extension_loaded`` checks that.

Tolerances: merge follows the FA rule, ``max|kernel - fp64 ref| <= 2 * max|same-dtype torch ref - fp64 ref| +
1e-6``; commit_kv_ moves bytes, so it is compared byte for byte.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import longspec_ops
from longspec_ops.reference import attention as ref

pytestmark = pytest.mark.requires_cuda

DEVICE = "cuda"
MERGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# (B, M, H, D): decode (M = 1), tree verification (M = 26), odd head dims that defeat 16-byte vectors.
MERGE_SHAPES = ((1, 1, 8, 128), (3, 26, 4, 64), (2, 5, 3, 33), (8, 4, 2, 256))
# How out_a is laid out: "contiguous", "mh_transposed" ([B, H, M, D] storage viewed as [B, M, H, D]; rows stay
# 16-byte aligned so the vectorised path runs) and "misaligned" (one element of storage offset and a padded
# row: the scalar path).
MERGE_LAYOUTS = ("contiguous", "mh_transposed", "misaligned")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _out_tensor(shape, dtype, layout: str, g: torch.Generator) -> torch.Tensor:
    B, M, H, D = shape
    if layout == "contiguous":
        return torch.randn(B, M, H, D, device=DEVICE, generator=g).to(dtype)
    if layout == "mh_transposed":
        return torch.randn(B, H, M, D, device=DEVICE, generator=g).to(dtype).transpose(1, 2)
    if layout == "misaligned":
        return torch.randn(B, M, H, D + 1, device=DEVICE, generator=g).to(dtype)[..., 1:]
    raise ValueError(layout)


def _lse_pair(B: int, H: int, M: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [B, H, M] LSEs (lse_a strided) where rows are empty (-inf) on side a only, b only, or both."""
    lse_a = 3.0 * torch.randn(B, H, M, device=DEVICE, generator=g)
    lse_b = 3.0 * torch.randn(B, H, M, device=DEVICE, generator=g)
    # 0: both finite, 1: a empty, 2: b empty, 3: both empty, 4: both finite; the first rows take every kind.
    kind = torch.randint(0, 5, (B, H, M), device=DEVICE, generator=g)
    n = min(4, kind.numel())
    kind.view(-1)[:n] = torch.arange(n, device=DEVICE)
    lse_a = lse_a.masked_fill((kind == 1) | (kind == 3), float("-inf"))
    lse_b = lse_b.masked_fill((kind == 2) | (kind == 3), float("-inf"))
    lse_a = lse_a.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (M*H, 1, H)
    return lse_a, lse_b


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _max_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() - y.double()).abs().max().item() if x.numel() else 0.0


# ---------------------------------------------------------------------------------------------------------
# the extension is there
# ---------------------------------------------------------------------------------------------------------


def test_extension_loaded():
    assert longspec_ops.has_cuda_kernels(), getattr(longspec_ops, "_C_IMPORT_ERROR", "longspec_ops._C did not load")
    for op in ("_merge_attn_states_kernel", "_commit_kv_kernel"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"longspec::{op}", "CUDA")
        # The CUDA kernel must be the C++ one from csrc/bindings.cpp, not the Python reference fallback.
        table = torch._C._dispatch_dump(f"longspec::{op}")
        cuda_line = next(line for line in table.splitlines() if line.startswith("CUDA"))
        assert "bindings.cpp" in cuda_line, table


# ---------------------------------------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", MERGE_LAYOUTS)
@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", MERGE_DTYPES, ids=str)
def test_merge_matches_reference(dtype, shape, layout):
    B, M, H, D = shape
    g = _gen(_seed(dtype, shape, layout))
    out_a = _out_tensor(shape, dtype, layout, g)
    out_b = _out_tensor(shape, dtype, "contiguous", g)
    lse_a, lse_b = _lse_pair(B, H, M, g)

    out, lse = torch.ops.longspec.merge_attn_states(out_a, lse_a, out_b, lse_b)

    assert out.shape == (B, M, H, D) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (B, H, M) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.device == out_a.device and lse.device == out_a.device

    out_ref, lse_ref = ref.merge_attn_states(out_a, lse_a, out_b, lse_b)  # same dtype, fp32 math
    out_64, _ = ref.merge_attn_states(out_a.double(), lse_a, out_b.double(), lse_b)
    lse_64 = torch.logaddexp(lse_a.double(), lse_b.double())

    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(lse_64)  # both sides empty: lse -inf and out exactly 0
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.transpose(1, 2)[empty] == 0).all()

    tol_out = 2 * _max_err(out_ref, out_64) + 1e-6
    assert _max_err(out, out_64) <= tol_out
    finite = ~empty
    tol_lse = 2 * _max_err(lse_ref[finite], lse_64[finite]) + 1e-6
    assert _max_err(lse[finite], lse_64[finite]) <= tol_lse


def test_merge_one_side_empty_is_the_other_side():
    g = _gen(1)
    out_a = torch.randn(2, 3, 4, 64, device=DEVICE, generator=g, dtype=torch.float32)
    out_b = torch.randn(2, 3, 4, 64, device=DEVICE, generator=g, dtype=torch.float32)
    lse_b = torch.randn(2, 4, 3, device=DEVICE, generator=g)
    lse_a = torch.full_like(lse_b, float("-inf"))
    out, lse = torch.ops.longspec.merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lse_b, rtol=0, atol=0)


@pytest.mark.parametrize("shape", ((0, 3, 4, 64), (2, 0, 4, 64), (2, 3, 4, 0)), ids=lambda s: "x".join(map(str, s)))
def test_merge_empty_shapes(shape):
    B, M, H, D = shape
    out_a = torch.zeros(shape, device=DEVICE, dtype=torch.float16)
    lse_a = torch.zeros(B, H, M, device=DEVICE)
    out, lse = torch.ops.longspec.merge_attn_states(out_a, lse_a, out_a.clone(), lse_a.clone())
    assert out.shape == shape and lse.shape == (B, H, M)
    if lse.numel():  # D = 0: lse is still computed
        torch.testing.assert_close(lse, lse_a + torch.log(torch.tensor(2.0)))


def test_merge_opcheck():
    g = _gen(2)
    out_a = _out_tensor((2, 5, 4, 64), torch.bfloat16, "mh_transposed", g)
    out_b = _out_tensor((2, 5, 4, 64), torch.bfloat16, "contiguous", g)
    lse_a, lse_b = _lse_pair(2, 4, 5, g)
    torch.library.opcheck(torch.ops.longspec.merge_attn_states, (out_a, lse_a, out_b, lse_b))


# ---------------------------------------------------------------------------------------------------------
# commit_kv_
# ---------------------------------------------------------------------------------------------------------

# name -> (accept_index rows, accept_lens, cache_seqlens). Rows overlap sources and destinations on purpose.
COMMIT_CASES = {
    # the brief's example: row s+2 is the source of j = 1 and the destination of j = 2
    "tree_paths": ([[0, 2, 5, 7], [0, 1, 3, 4], [0, 1, 2, 3]], [3, 4, 4], [5, 0, 10]),
    # every length from 0 to A on one index row
    "all_lengths": ([[0, 2, 5, 6, 9]] * 6, [0, 1, 2, 3, 4, 5], [0, 3, 7, 1, 12, 4]),
    # a cycle: each destination is also the source of another j, so reading after any write is wrong
    "cycle": ([[1, 2, 3, 0]], [4], [6]),
    "reverse": ([[4, 3, 2, 1, 0]], [5], [2]),
    # repeated sources are allowed (the reference gathers then scatters)
    "duplicates": ([[3, 3, 0, 3], [0, 0, 0, 0]], [4, 3], [1, 8]),
}


def _commit_inputs(P, B, N, Hkv, D, dtype, index_rows, lens, seqlens, idx_dtype, g):
    kv = torch.randn(P, B, N, Hkv, D, device=DEVICE, generator=g).to(dtype)
    accept_index = torch.tensor(index_rows, device=DEVICE, dtype=idx_dtype)
    accept_lens = torch.tensor(lens, device=DEVICE, dtype=idx_dtype)
    cache_seqlens = torch.tensor(seqlens, device=DEVICE, dtype=idx_dtype)
    return kv, cache_seqlens, accept_index, accept_lens


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("idx_dtype", (torch.int32, torch.int64), ids=str)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("case", sorted(COMMIT_CASES))
def test_commit_matches_reference(case, dtype, idx_dtype):
    index_rows, lens, seqlens = COMMIT_CASES[case]
    B = len(index_rows)
    g = _gen(_seed(case, dtype, idx_dtype))
    kv, cache_seqlens, accept_index, accept_lens = _commit_inputs(
        4, B, 24, 2, 64, dtype, index_rows, lens, seqlens, idx_dtype, g
    )
    expected = kv.clone()
    ref.commit_kv_(expected, cache_seqlens, accept_index, accept_lens)
    torch.ops.longspec.commit_kv_(kv, cache_seqlens, accept_index, accept_lens)
    assert torch.equal(_bytes(kv), _bytes(expected))


# (Hkv, D, dtype): rows of 2 KiB (several column slices per block with A = 48), and rows of 6, 4 and 2 bytes
# that force 2-, 4- and 2-byte words.
@pytest.mark.parametrize(
    "hkv,d,dtype",
    ((8, 128, torch.bfloat16), (1, 3, torch.float16), (1, 1, torch.float32), (1, 1, torch.float16)),
    ids=("2KiB-rows", "6B-rows", "4B-rows", "2B-rows"),
)
def test_commit_random_long_paths(hkv, d, dtype):
    P, B, N, A = 6, 3, 160, 48
    g = _gen(3)
    kv = torch.randn(P, B, N, hkv, d, device=DEVICE, generator=g).to(dtype)
    accept_index = torch.randint(0, 100, (B, A), device=DEVICE, generator=g, dtype=torch.int32)
    accept_lens = torch.tensor([A, 17, 0], device=DEVICE, dtype=torch.int32)
    cache_seqlens = torch.tensor([0, 9, 50], device=DEVICE, dtype=torch.int32)
    expected = kv.clone()
    ref.commit_kv_(expected, cache_seqlens, accept_index, accept_lens)
    torch.ops.longspec.commit_kv_(kv, cache_seqlens, accept_index, accept_lens)
    assert torch.equal(_bytes(kv), _bytes(expected))


def test_commit_misaligned_storage_offset():
    """A contiguous view that starts 2 bytes into its storage: the kernel must drop to 2-byte words."""
    P, B, N, Hkv, D = 2, 2, 16, 2, 8
    g = _gen(4)
    storage = torch.randn(P * B * N * Hkv * D + 1, device=DEVICE, generator=g).to(torch.float16)
    kv = storage[1:].view(P, B, N, Hkv, D)
    assert kv.is_contiguous() and kv.data_ptr() % 16 != 0
    cache_seqlens = torch.tensor([3, 0], device=DEVICE, dtype=torch.int32)
    accept_index = torch.tensor([[0, 2, 5], [1, 0, 2]], device=DEVICE, dtype=torch.int32)
    accept_lens = torch.tensor([3, 3], device=DEVICE, dtype=torch.int32)
    before = storage.clone()
    expected = kv.clone()
    ref.commit_kv_(expected, cache_seqlens, accept_index, accept_lens)
    torch.ops.longspec.commit_kv_(kv, cache_seqlens, accept_index, accept_lens)
    assert torch.equal(_bytes(kv), _bytes(expected))
    assert torch.equal(storage[:1], before[:1])  # the element before the view is untouched


def test_commit_skips_out_of_range_rows():
    """Bad lengths and indices never write outside [0, N): those rows are skipped, the rest still move."""
    P, B, N, Hkv, D = 2, 2, 8, 1, 16
    g = _gen(5)
    kv = torch.randn(P, B, N, Hkv, D, device=DEVICE, generator=g)
    # b = 0: j = 0, 1 swap rows N-2 and N-1; j = 2, 3 would write rows N and N+1 (beyond the cache); the
    # length 9 > A is clamped to A. b = 1: every source lies beyond the cache or before it.
    cache_seqlens = torch.tensor([N - 2, 0], device=DEVICE, dtype=torch.int32)
    accept_index = torch.tensor([[1, 0, 0, 0], [N + 5, -3, 2 * N, N]], device=DEVICE, dtype=torch.int32)
    accept_lens = torch.tensor([9, 4], device=DEVICE, dtype=torch.int32)
    expected = kv.clone()
    expected[:, 0, N - 2], expected[:, 0, N - 1] = kv[:, 0, N - 1], kv[:, 0, N - 2]
    torch.ops.longspec.commit_kv_(kv, cache_seqlens, accept_index, accept_lens)
    assert torch.equal(_bytes(kv), _bytes(expected))


def test_commit_empty_inputs_are_noops():
    kv = torch.randn(2, 3, 8, 2, 4, device=DEVICE)
    before = kv.clone()
    i32 = dict(device=DEVICE, dtype=torch.int32)
    torch.ops.longspec.commit_kv_(kv, torch.zeros(3, **i32), torch.zeros(3, 0, **i32), torch.zeros(3, **i32))
    torch.ops.longspec.commit_kv_(kv, torch.zeros(3, **i32), torch.zeros(3, 4, **i32), torch.zeros(3, **i32))
    assert torch.equal(kv, before)


def test_commit_opcheck():
    g = _gen(6)
    kv, cache_seqlens, accept_index, accept_lens = _commit_inputs(
        4, 3, 24, 2, 64, torch.float16, *COMMIT_CASES["tree_paths"], torch.int32, g
    )
    torch.library.opcheck(torch.ops.longspec.commit_kv_, (kv, cache_seqlens, accept_index, accept_lens))


def test_cuda_graph_capture():
    """Both kernels run on the current stream without host syncs, so they replay inside a CUDA graph."""
    g = _gen(7)
    kv, cache_seqlens, accept_index, accept_lens = _commit_inputs(
        4, 3, 24, 2, 64, torch.bfloat16, *COMMIT_CASES["tree_paths"], torch.int32, g
    )
    expected = kv.clone()
    ref.commit_kv_(expected, cache_seqlens, accept_index, accept_lens)
    out_a = _out_tensor((3, 5, 4, 64), torch.float16, "contiguous", g)
    out_b = _out_tensor((3, 5, 4, 64), torch.float16, "contiguous", g)
    lse_a, lse_b = _lse_pair(3, 4, 5, g)
    out_eager, lse_eager = torch.ops.longspec.merge_attn_states(out_a, lse_a, out_b, lse_b)

    static_kv = kv.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture
        torch.ops.longspec.commit_kv_(static_kv.clone(), cache_seqlens, accept_index, accept_lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.longspec.commit_kv_(static_kv, cache_seqlens, accept_index, accept_lens)
        out_g, lse_g = torch.ops.longspec.merge_attn_states(out_a, lse_a, out_b, lse_b)
    static_kv.copy_(kv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bytes(static_kv), _bytes(expected))
    assert torch.equal(out_g, out_eager) and torch.equal(lse_g, lse_eager)


@pytest.mark.parametrize("case", sorted(COMMIT_CASES))
def test_reference_commit_captures_in_a_cuda_graph(case):
    """The PyTorch reference is commit_kv_'s CUDA fallback when _C is missing, so it must capture too (its
    boolean-indexing form broke a capture on an H100: cudaErrorStreamCaptureInvalidated). Replayed on a second set
    of values, it equals the reference run on the CPU."""
    index_rows, lens, seqlens = COMMIT_CASES[case]
    g = _gen(_seed("capture", case))
    kv, cache_seqlens, accept_index, accept_lens = _commit_inputs(
        3, len(index_rows), 24, 2, 16, torch.bfloat16, index_rows, lens, seqlens, torch.int32, g
    )
    static_kv = kv.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture
        ref.commit_kv_(static_kv.clone(), cache_seqlens, accept_index, accept_lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ref.commit_kv_(static_kv, cache_seqlens, accept_index, accept_lens)
    fresh = torch.randn(kv.shape, device=DEVICE, generator=g).to(kv.dtype)
    expected = fresh.cpu()
    ref.commit_kv_(expected, cache_seqlens.cpu(), accept_index.cpu(), accept_lens.cpu())
    static_kv.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bytes(static_kv.cpu()), _bytes(expected))


# ---------------------------------------------------------------------------------------------------------
# bad input: the public ops check in Python (ValueError naming the argument) before the C++ kernel runs
# ---------------------------------------------------------------------------------------------------------


def _merge_args():
    out = torch.randn(2, 3, 4, 64, device=DEVICE, dtype=torch.float16)
    lse = torch.randn(2, 4, 3, device=DEVICE)
    return [out, lse, out.clone(), lse.clone()]


@pytest.mark.parametrize(
    "position,bad,match",
    (
        (1, lambda a: a[1].half(), "lse_a must be float32"),
        (3, lambda a: a[3][:, :, :2], "lse_b must have shape"),
        (2, lambda a: a[2][:, :, :, :32], "out_b must have out_a's shape"),
        (2, lambda a: a[2].float(), "out_b must have out_a's dtype"),
        (0, lambda a: a[0].transpose(2, 3).contiguous().transpose(2, 3), "out_a must have a contiguous last"),
        (0, lambda a: a[0][0], "out_a must be 4-D"),
        (0, lambda a: a[0].int(), "out_a must be float16, bfloat16, float32 or float64"),
        (3, lambda a: a[3].cpu(), "all tensors must be on one device"),
    ),
    ids=("lse_a-dtype", "lse_b-shape", "out_b-shape", "out_b-dtype", "out_a-strides", "out_a-rank", "out_a-dtype",
         "lse_b-device"),
)
def test_merge_bad_input(position, bad, match):
    args = _merge_args()
    args[position] = bad(args)
    with pytest.raises(ValueError, match=match):
        torch.ops.longspec.merge_attn_states(*args)


def _commit_args():
    i32 = dict(device=DEVICE, dtype=torch.int32)
    kv = torch.randn(4, 2, 16, 2, 8, device=DEVICE)
    return [kv, torch.zeros(2, **i32), torch.zeros(2, 3, **i32), torch.ones(2, **i32)]


@pytest.mark.parametrize(
    "position,bad,match",
    (
        (0, lambda a: a[0].transpose(3, 4), "kv_cache must be contiguous"),
        (0, lambda a: a[0][0], "kv_cache must be 5-D"),
        (1, lambda a: a[1].float(), "cache_seqlens must be int32"),
        (1, lambda a: a[1][:1], r"cache_seqlens must be int32 \[B\] = \(2,\)"),
        (2, lambda a: a[2].float(), "accept_index must be int32"),
        (2, lambda a: a[2][0], "accept_index must be int32"),
        (3, lambda a: a[3][None], "accept_lens must be int32"),
        (2, lambda a: a[2].cpu(), "all tensors must be on one device"),
    ),
    ids=("kv-strides", "kv-rank", "seqlens-dtype", "seqlens-shape", "index-dtype", "index-rank", "lens-rank",
         "index-device"),
)
def test_commit_bad_input(position, bad, match):
    args = _commit_args()
    args[position] = bad(args)
    before = args[0].clone() if args[0].is_contiguous() else None
    with pytest.raises(ValueError, match=match):
        torch.ops.longspec.commit_kv_(*args)
    if before is not None:
        assert torch.equal(args[0], before)


def test_commit_rejects_too_long_paths():
    args = _commit_args()
    args[2] = torch.zeros(2, 1025, device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match="accept_index may hold at most 1024 entries per row"):
        torch.ops.longspec.commit_kv_(*args)
