"""The Triton kernels of ``longspec_ops.kernels`` against the PyTorch references.

Without a GPU they run on CPU tensors under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``
before triton is imported); with one, on CUDA. Tolerance is FlashAttention's rule: against a float64 oracle, the
kernel's max abs error must be within 2x that of the same-precision PyTorch reference (the reference run on the
kernel-dtype inputs), plus a tiny absolute floor. Shapes are small and the grid focused: the interpreter is slow.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from longspec_ops.kernels import configs as C  # noqa: E402
from longspec_ops.kernels import launch as K  # noqa: E402
from longspec_ops.kernels import hybrid_tree_attn, prefix_attn, tree_attn  # noqa: E402
from longspec_ops.reference import attention as ref  # noqa: E402

from longspec.testing import beam_tree_mask  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
# The interpreter's bfloat16 tl.dot is unreliable, so bf16 is only checked on a real GPU.
DTYPES = [torch.float16, torch.float32] + ([] if INTERPRET else [torch.bfloat16])
HEADS = [(4, 2), (6, 1), (4, 4)]  # (Hq, Hkv): G = 2, 6, 1
OUT_FLOOR = 1e-6  # absolute floor on out: covers cases where the same-precision reference is exact
LSE_FLOOR = 1e-5  # lse is float32 in both; this covers fp32 rounding of a different summation order
# Tiny tiles and a forced split size: many splits, many row tiles and many key blocks even at small shapes. The
# table configs load 16-bit caches through TMA descriptors (the interpreter emulates them); split48 uses pointers.
SPLIT = C.AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, split_rows=48, tma=False)
CONFIGS = {"table": None, "split48": SPLIT}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_loop_bounds():
    """triton 3.6's interpreter turns loop bounds into ints with ``int(ndarray)``, but computed scalars are
    1-element 1-D arrays there, which numpy >= 2.4 refuses. Take the element instead (interpreter only)."""
    if not INTERPRET:
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    yield
    interpreter._patch_lang_tensor = original


def _randn(*shape, dtype, strided, gen):
    """[B, S, H, D]; with ``strided`` a transposed view of a [B, H, S, D] tensor (as transformers passes them)."""
    if strided:
        B, S, H, D = shape
        return torch.randn(B, H, S, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _inputs(B, M, N, Hq, Hkv, D, dtype, strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = _randn(B, M, Hq, D, dtype=dtype, strided=strided, gen=g)
    kc = _randn(B, N, Hkv, D, dtype=dtype, strided=strided, gen=g)
    vc = _randn(B, N, Hkv, D, dtype=dtype, strided=strided, gen=g)
    kt = _randn(B, M, Hkv, D, dtype=dtype, strided=strided, gen=g)
    vt = _randn(B, M, Hkv, D, dtype=dtype, strided=strided, gen=g)
    return q, kc, vc, kt, vt


def _ragged_lens(B, N, seed=0):
    """[B] lengths including N (full cache) and 0 (empty), the rest random."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, N + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = N
    if B > 1:
        lens[1] = 0
    return lens.to(DEVICE)


def _random_mask(B, M, seed=0, empty_rows=((0, -1),)):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, M, M, generator=g) < 0.5
    for b, i in empty_rows:
        mask[b, i] = False  # a query that sees no tree key
    return mask.to(DEVICE)


def _scale(D):
    return 1.5 / math.sqrt(D)  # a little sharper than 1/sqrt(D), so softmax rows are not flat


def _check(got, fn, args, dtype):
    """``got``: the kernel's (out, lse) for ``fn(*args)``. Compare with the float64 oracle and the same-precision
    reference (``fn`` on the kernel-dtype inputs)."""
    out, lse = got
    q = args[0]
    B, M, Hq, D = q.shape
    assert out.shape == (B, M, Hq, D) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (B, Hq, M) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()

    up = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    o64, l64 = fn(*up)
    o_same, l_same = fn(*args)

    # Queries with no visible key: exactly out 0 and lse -inf.
    empty = torch.isinf(l64)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert (out.transpose(1, 2)[empty] == 0).all()

    err = (out.double() - o64).abs().max().item()
    ref_err = (o_same.double() - o64).abs().max().item()
    assert err <= 2 * ref_err + OUT_FLOOR, f"out error {err:.3g} vs reference error {ref_err:.3g}"
    fin = ~empty
    if fin.any():
        lerr = (lse.double() - l64)[fin].abs().max().item()
        lref = (l_same.double() - l64)[fin].abs().max().item()
        assert lerr <= 2 * lref + LSE_FLOOR, f"lse error {lerr:.3g} vs reference error {lref:.3g}"


# prefix_attn ------------------------------------------------------------------------------------------------------
# (D, M, N, strided): N straddles BLOCK_N (0, 1, 97, 300); M = 1 is decode.
PREFIX_CASES = [(64, 1, 0, False), (64, 5, 97, True), (96, 19, 300, False), (96, 1, 300, True), (64, 19, 1, True)]


# The forced-split grid runs only with G > 1 head pairs (MHA is covered by the table configs): keeps the CPU run short.
PREFIX_GRID = [(h, c) for h in HEADS for c in CONFIGS if c == "table" or h != (4, 4)]


@pytest.mark.parametrize("heads,config", PREFIX_GRID)
@pytest.mark.parametrize("D,M,N,strided", PREFIX_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix(dtype, heads, D, M, N, strided, config):
    Hq, Hkv = heads
    B = 3
    q, kc, vc, _, _ = _inputs(B, M, N, Hq, Hkv, D, dtype, strided, seed=D + M + N)
    lens = _ragged_lens(B, N, seed=N)
    args = (q, kc, vc, lens, _scale(D))
    _check(prefix_attn(*args, config=CONFIGS[config]), ref.prefix_attn, args, dtype)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (6, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_per_query_lens(dtype, Hq, Hkv, config):
    """[B, M] lengths (the draft's cross-attention): rows of one tile stop at different keys."""
    B, M, N, D = 2, 19, 300, 64
    q, kc, vc, _, _ = _inputs(B, M, N, Hq, Hkv, D, dtype, strided=True, seed=3)
    g = torch.Generator().manual_seed(4)
    lens = torch.randint(0, N + 1, (B, M), generator=g, dtype=torch.int64)  # int64 is accepted too
    lens[0, :3] = torch.tensor([0, N, 1])
    lens[1] = torch.arange(250, 250 + M)  # a causal-like staircase crossing block and split edges
    args = (q, kc, vc, lens.to(DEVICE), _scale(D))
    _check(prefix_attn(*args, config=CONFIGS[config]), ref.prefix_attn, args, dtype)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prefix_clamps_bad_lengths(config):
    """Lengths outside [0, N] are clamped on the device, never read out of bounds."""
    B, M, N, Hq, Hkv, D = 3, 5, 97, 4, 2, 64
    q, kc, vc, _, _ = _inputs(B, M, N, Hq, Hkv, D, torch.float32, seed=5)
    lens = torch.tensor([-7, N + 1000, 2**31 - 1], dtype=torch.int32, device=DEVICE)
    out, lse = prefix_attn(q, kc, vc, lens, _scale(D), config=CONFIGS[config])
    args = (q, kc, vc, lens.clamp(0, N), _scale(D))
    _check((out, lse), ref.prefix_attn, args, torch.float32)


def test_prefix_merge_in_steps():
    """38 splits: the split merge takes them 32 per step with an online rescale between steps."""
    B, M, N, Hq, Hkv, D = 3, 3, 600, 4, 2, 64
    cfg = C.AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, split_rows=16)
    assert C.plan_splits(N, B * Hkv, 16, 16, 8, 16)[0] == 38 and C.merge_tile(38, M * 2, 64)[0] == 32
    q, kc, vc, _, _ = _inputs(B, M, N, Hq, Hkv, D, torch.float16, seed=21)
    lens = torch.tensor([N, 0, 517], dtype=torch.int32, device=DEVICE)  # full, empty, ends inside the 2nd step
    args = (q, kc, vc, lens, _scale(D))
    _check(prefix_attn(*args, config=cfg), ref.prefix_attn, args, torch.float16)


@pytest.mark.parametrize("tma", [True, False])
def test_unwritten_cache_rows_are_never_used(tma):
    """Cache rows at or past a row's length may hold anything (unwritten capacity): NaN/inf there must not leak into
    the output. TMA loads whole blocks, so its ragged block zeroes V's hidden rows (0 * NaN = NaN otherwise)."""
    B, M, N, Hq, Hkv, D = 2, 5, 97, 4, 2, 64
    q, kc, vc, kt, vt = _inputs(B, M, N, Hq, Hkv, D, torch.float16, seed=31)
    lens = torch.tensor([70, 33], dtype=torch.int32, device=DEVICE)
    hidden = torch.arange(N, device=DEVICE)[None, :] >= lens[:, None]  # [B, N]
    dirty_k, dirty_v = kc.clone(), vc.clone()
    dirty_k[hidden] = float("nan")
    dirty_v[hidden] = float("inf")
    mask = _random_mask(B, M, seed=32, empty_rows=())
    cfg = C.AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, split_rows=32, tma=tma)
    assert K.tma_eligible(dirty_k) and K.tma_eligible(dirty_v)
    args = (q, kc, vc, lens, kt, vt, mask, _scale(D))
    _check(hybrid_tree_attn(q, dirty_k, dirty_v, lens, kt, vt, mask, _scale(D), config=cfg),
           ref.hybrid_tree_attn, args, torch.float16)
    _check(prefix_attn(q, dirty_k, dirty_v, lens, _scale(D), config=cfg), ref.prefix_attn,
           (q, kc, vc, lens, _scale(D)), torch.float16)


def test_tma_eligible():
    """TMA needs 16-bit data, a 16-byte aligned base and 16-byte multiple strides; other caches use pointers."""
    B, N, Hkv, D = 2, 50, 2, 64
    kc = torch.randn(B, N, Hkv, D, dtype=torch.float16, device=DEVICE)
    assert K.tma_eligible(kc) and K.tma_eligible(kc.transpose(1, 2).contiguous().transpose(1, 2))
    assert not K.tma_eligible(kc.float())
    shifted = torch.randn(B * N * Hkv * D + 1, dtype=torch.float16, device=DEVICE)[1:].view(B, N, Hkv, D)
    assert not K.tma_eligible(shifted)  # base 2 bytes past an aligned address
    odd = torch.randn(B, N, Hkv, D + 4, dtype=torch.float16, device=DEVICE)[..., :D]
    assert not K.tma_eligible(odd)  # row stride of 68 halves = 136 bytes
    # Both run the pointer path and are still exact.
    M, Hq = 5, 4
    q, _, _, kt, vt = _inputs(B, M, N, Hq, Hkv, D, torch.float16, seed=33)
    lens = torch.tensor([N, 17], dtype=torch.int32, device=DEVICE)
    shifted.copy_(kc)
    odd.copy_(kc)
    vc = torch.randn_like(kc)
    for cache in (shifted, odd):
        args = (q, cache, vc, lens, _scale(D))
        _check(prefix_attn(*args), ref.prefix_attn, args, torch.float16)


def test_merge_tile():
    assert C.merge_tile(16, 4, 128) == (16, 2)  # decode: 16 splits x 2 rows x 128 = one 4096-element step
    assert C.merge_tile(12, 296, 128) == (16, 2)
    assert C.merge_tile(200, 296, 128) == (32, 1)  # many splits: 32 per step
    assert C.merge_tile(2, 1, 64) == (2, 1)


# tree_attn --------------------------------------------------------------------------------------------------------
TREE_CONFIG = C.AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)  # several row tiles and key blocks


@pytest.mark.parametrize("config", ["table", "tiny"])
@pytest.mark.parametrize("D,M,strided", [(64, 1, False), (96, 5, True), (64, 19, True)])
@pytest.mark.parametrize("Hq,Hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree(dtype, Hq, Hkv, D, M, strided, config):
    B = 2
    q, _, _, kt, vt = _inputs(B, M, 1, Hq, Hkv, D, dtype, strided, seed=M)
    mask = _random_mask(B, M, seed=M, empty_rows=((0, M - 1), (1, 0)))
    args = (q, kt, vt, mask, _scale(D))
    _check(tree_attn(*args, config=TREE_CONFIG if config == "tiny" else None), ref.tree_attn, args, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_beam_mask(dtype):
    """A 4-16-16 beam tree (root + 36 nodes); the mask is a non-contiguous view."""
    B, Hq, Hkv, D = 2, 4, 2, 64
    base = beam_tree_mask((4, 16, 16), B, torch.Generator().manual_seed(6))
    M = base.shape[1]
    mask = base.transpose(1, 2).contiguous().transpose(1, 2).to(DEVICE)  # same values, column-major strides
    q, _, _, kt, vt = _inputs(B, M, 1, Hq, Hkv, D, dtype, strided=True, seed=7)
    args = (q, kt, vt, mask, _scale(D))
    _check(tree_attn(*args), ref.tree_attn, args, dtype)


# hybrid_tree_attn -------------------------------------------------------------------------------------------------
HYBRID_CASES = [(64, 1, 0, False), (96, 5, 97, True), (64, 19, 300, True)]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("D,M,N,strided", HYBRID_CASES)
@pytest.mark.parametrize("Hq,Hkv", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid(dtype, Hq, Hkv, D, M, N, strided, config):
    """Fused (the tree block in the last split) against the reference: prefix + tree merged by LSE."""
    B = 2
    q, kc, vc, kt, vt = _inputs(B, M, N, Hq, Hkv, D, dtype, strided, seed=11 + M)
    lens = _ragged_lens(B, N, seed=12)  # row 1 has an empty cache ...
    mask = _random_mask(B, M, seed=13, empty_rows=((1, 0),))  # ... and its query 0 sees no tree key: nothing
    args = (q, kc, vc, lens, kt, vt, mask, _scale(D))
    _check(hybrid_tree_attn(*args, config=CONFIGS[config]), ref.hybrid_tree_attn, args, dtype)


@pytest.mark.parametrize("D", [40, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_other_head_dims(dtype, D):
    """A small odd head dim (padded to 64) and the 256 table rows."""
    B, M, N, Hq, Hkv = 2, 5, 97, 4, 2
    q, kc, vc, kt, vt = _inputs(B, M, N, Hq, Hkv, D, dtype, strided=True, seed=D)
    lens = _ragged_lens(B, N, seed=D)
    mask = _random_mask(B, M, seed=D, empty_rows=((1, 4),))
    args = (q, kc, vc, lens, kt, vt, mask, _scale(D))
    _check(hybrid_tree_attn(*args), ref.hybrid_tree_attn, args, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_composed_backend(dtype):
    """The fallback composition (prefix + tree + merge_attn_states) meets the same bar as the fused launch."""
    B, M, N, Hq, Hkv, D = 2, 5, 97, 4, 2, 64
    q, kc, vc, kt, vt = _inputs(B, M, N, Hq, Hkv, D, dtype, seed=14)
    lens = _ragged_lens(B, N, seed=15)
    mask = _random_mask(B, M, seed=16, empty_rows=((1, 2),))
    args = (q, kc, vc, lens, kt, vt, mask, _scale(D))
    got = hybrid_tree_attn(*args, backend=C.HybridBackend.COMPOSED, config=SPLIT)
    _check(got, ref.hybrid_tree_attn, args, dtype)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("K", [0, 21, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_and_tree_with_more_tree_keys_than_queries(dtype, K, config):
    """One drafter level: M = 5 queries over a 97-row window and K tree keys (all nodes drafted so far; K > one
    tree key block of the tiny config), under a [B, M, K] mask."""
    B, M, N, Hq, Hkv, D = 2, 5, 97, 4, 2, 64
    q, kc, vc, _, _ = _inputs(B, M, N, Hq, Hkv, D, dtype, strided=True, seed=30 + K)
    g = torch.Generator().manual_seed(31 + K)
    kt = _randn(B, K, Hkv, D, dtype=dtype, strided=True, gen=g)
    vt = _randn(B, K, Hkv, D, dtype=dtype, strided=True, gen=g)
    mask = (torch.rand(B, M, K, generator=g) < 0.5).to(DEVICE)
    lens = _ragged_lens(B, N, seed=32)
    args = (q, kc, vc, lens, kt, vt, mask, _scale(D))
    _check(hybrid_tree_attn(*args, config=CONFIGS[config]), ref.hybrid_tree_attn, args, dtype)
    if K:
        targs = (q, kt, vt, mask, _scale(D))
        _check(tree_attn(*targs, config=TREE_CONFIG if config == "split48" else None), ref.tree_attn, targs, dtype)


def test_hybrid_beam_tree_many_splits():
    """The 4-16-16-16-16 tree (69 tokens) after a 300-row cache, strided inputs, 7 cache splits, the tree in the last."""
    B, N, Hq, Hkv, D = 2, 300, 4, 2, 64
    mask = beam_tree_mask((4, 16, 16, 16, 16), B, torch.Generator().manual_seed(17)).to(DEVICE)
    M = mask.shape[1]
    q, kc, vc, kt, vt = _inputs(B, M, N, Hq, Hkv, D, torch.float16, strided=True, seed=18)
    lens = torch.tensor([300, 123], dtype=torch.int32, device=DEVICE)
    cfg = C.AttnConfig(block_m=64, block_n=16, num_warps=4, num_stages=1, split_rows=48)
    assert C.plan_splits(N, B * Hkv * math.ceil(M * Hq // Hkv / 64), 64, 16, 8, 48) == (7, 48)
    args = (q, kc, vc, lens, kt, vt, mask, _scale(D))
    _check(hybrid_tree_attn(*args, config=cfg), ref.hybrid_tree_attn, args, torch.float16)


# Launch planning and dtype routing --------------------------------------------------------------------------------
def test_plan_splits_is_shape_only_and_covers_the_cache():
    # Llama-3-8B at 32k on 132 SMs: decode (one 16-row tile per kv head, 2 programs per SM) and tree verify
    # (74 tokens x G = 4 = 296 rows in three 128-row tiles).
    for n, base, block_m, block_n, slots in [(32768, 8, 16, 64, 264), (32768, 24, 128, 64, 132),
                                             (97, 6, 16, 16, 8), (1 << 20, 1, 16, 64, 264), (1, 1024, 128, 64, 132)]:
        splits, rows = C.plan_splits(n, base, block_m, block_n, slots)
        assert rows % block_n == 0 and splits >= 1
        assert (splits - 1) * rows < n <= splits * rows  # every split non-empty, the cache covered
        assert splits <= C._MAX_SPLITS
    assert C.plan_splits(32768, 8, 16, 64, 264)[0] > 8  # long decode is split across the SMs
    assert C.plan_splits(0, 8, 16, 64, 264)[0] == 0
    assert C.plan_splits(300, 8, 16, 16, 8, 40) == (7, 48)  # a forced split size rounds up to block_n


def test_float64_takes_the_reference():
    B, M, N, Hq, Hkv, D = 1, 3, 20, 4, 2, 16
    q, kc, vc, kt, vt = _inputs(B, M, N, Hq, Hkv, D, torch.float64, seed=19)
    lens = torch.tensor([25], device=DEVICE)  # beyond N: clamped like the kernels do
    mask = _random_mask(B, M, seed=20, empty_rows=())
    out, lse = hybrid_tree_attn(q, kc, vc, lens, kt, vt, mask, 0.3)
    want = ref.hybrid_tree_attn(q, kc, vc, lens.clamp(0, N), kt, vt, mask, 0.3)
    assert out.dtype == torch.float64 and torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_config_validation():
    with pytest.raises(ValueError, match="block_m"):
        C.AttnConfig(block_m=8, block_n=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_n"):
        C.AttnConfig(block_m=16, block_n=48, num_warps=4, num_stages=2)
    assert C.split_config(128, 296, torch.bfloat16).block_m == 128
    assert C.split_config(128, 4, torch.bfloat16).block_m == 16
    assert C.split_config(96, 4, torch.float32).block_n == 16
