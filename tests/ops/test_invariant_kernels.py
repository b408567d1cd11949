"""The batch-invariant Triton kernels (``longspec_ops.kernels.invariant``): against their references, and row
invariance (a row computed alone, inside a wide call and inside a batch is bitwise the same).

Without a GPU they run under the Triton interpreter, where ``tl.dot`` is numpy's matmul, and numpy's (BLAS) matmul
is *not* row-invariant: the same row can round differently at another row position of the same product. There the
invariance tests replace the interpreter's dot by a row-by-row matmul (:func:`_row_local_dot`), so they check the
kernels' own logic (fixed splits and tiles, the ancestor indirection, the shared/per-query block paths, the split
merge); on CUDA they run the real kernels unchanged, and ``tests/decode/test_gpu_invariant.py`` repeats them in bf16
at model sizes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from longspec.decode.drafter import TreeSpec  # noqa: E402
from longspec.decode.tree import tree_mask_from_parents  # noqa: E402
from longspec.model.invariant import tree_ancestors  # noqa: E402
from longspec_ops.kernels.invariant_launch import (InvariantConfig, LinearTile, invariant_attn,  # noqa: E402
                                                   invariant_linear, linear_split_k, rms_norm)
from longspec_ops.reference import invariant as ref  # noqa: E402

from .test_triton_kernels import DEVICE, INTERPRET, _check, _interpreter_loop_bounds  # noqa: E402,F401

DTYPES = [torch.float16, torch.float32] + ([] if INTERPRET else [torch.bfloat16])
# Small tiles and splits so that a short cache spans many splits and the trees cross split and block boundaries;
# the merge takes 2 splits a step (rows end mid-step) and 16 of the head dimension's columns per program.
SMALL = InvariantConfig(linear_tiles=(LinearTile(1, 16, 16), LinearTile(16, 16, 32), LinearTile(1 << 62, 32, 16)),
                        linear_block_n=16, linear_k_step=32, attn_block_m=16, attn_block_n=16, split=32,
                        merge_block_s=2, merge_block_d=16)


@pytest.fixture
def _row_local_dot(monkeypatch):
    """Under the interpreter: ``tl.dot`` one row at a time (see the module docstring); on CUDA: nothing."""
    if not INTERPRET:
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # as tensor cores: 16-element K steps added in order to the accumulator, so the tile's K width (and rows)
        # cannot change a row's bits
        acc = d.data
        for k0 in range(0, a.data.shape[1], 16):
            rows = [np.matmul(a.data[i:i + 1, k0:k0 + 16], b.data[k0:k0 + 16], dtype=d.data.dtype)
                    for i in range(a.data.shape[0])]
            acc = acc + np.concatenate(rows, 0)
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# Linear and RMSNorm -------------------------------------------------------------------------------------------------
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float32: (1e-5, 1e-5)}


# Linear configs: the table's (tiles by M; K = 72 is one 128-wide K step, so no split), small tiles by M (split by the
# rule: under the interpreter a nominal 4 SMs, so these small N split), split-K off, and a forced uneven split (5 K
# blocks of 16 in 3 ranges of 32).
NO_SPLIT = InvariantConfig(linear_split_waves=0)
FORCED = InvariantConfig(linear_tiles=(LinearTile(1, 16, 16),), linear_block_n=16, linear_k_step=16, linear_split_k=3)
LINEAR_CONFIGS = [None, SMALL, NO_SPLIT, FORCED]
LINEAR_IDS = ["table", "small", "nosplit", "forced3"]


def test_linear_split_rule():
    """The split count is a function of (N, K, config, SMs): at Llama-3-8B's shapes on a 132-SM GPU narrow outputs
    get 1 .. 4 waves of programs at M = 1, each range a multiple of BLOCK_K, and the LM head is not split."""
    for cfg in (InvariantConfig(), InvariantConfig(linear_block_n=128)):
        for N, K in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)):
            split, k_split = linear_split_k(N, K, cfg, 132)
            tiles = -(-N // cfg.linear_block_n)
            assert k_split % cfg.linear_k_step == 0 and (split - 1) * k_split < K <= split * k_split
            if tiles >= 132:
                assert split == 1, (N, K)
            else:
                assert 132 <= tiles * split <= 4 * 132, (N, K, split)
    assert linear_split_k(40, 72, SMALL, 4) == (3, 32)  # the CPU tests below do split
    assert linear_split_k(40, 72, InvariantConfig(), 4) == (1, 128)
    assert linear_split_k(40, 72, NO_SPLIT, 4)[0] == 1 and linear_split_k(40, 72, FORCED, 4) == (3, 32)


@pytest.mark.parametrize("config", LINEAR_CONFIGS, ids=LINEAR_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_configs_match_reference(dtype, config):
    x, w = _rand(2, 19, 72, dtype=dtype, seed=0), _rand(40, 72, dtype=dtype, seed=1) * 0.1  # K, N straddle tiles
    b = _rand(40, dtype=dtype, seed=2)
    got = invariant_linear(x, w, b, config=config)
    want = ref.invariant_linear(x.double(), w.double(), b.double())
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("config,bias", [(None, False), (None, True), (SMALL, True)], ids=["table", "bias", "small"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference(dtype, bias, config):
    x, w = _rand(2, 19, 72, dtype=dtype, seed=0), _rand(40, 72, dtype=dtype, seed=1) * 0.1  # K, N straddle tiles
    b = _rand(40, dtype=dtype, seed=2) if bias else None
    got = invariant_linear(x, w, b, config=config)
    want = ref.invariant_linear(x.double(), w.double(), None if b is None else b.double())
    atol, rtol = TOL[dtype]
    assert got.shape == (2, 19, 40) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("H", [64, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype, H):
    x, w = _rand(2, 5, H, dtype=dtype, seed=3), _rand(H, dtype=dtype, seed=4)
    got = rms_norm(x, w, 1e-6)
    want = ref.rms_norm(x, w, 1e-6)  # same-dtype reference: the final rounding to x's dtype happens in both
    atol, rtol = TOL[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("scale", [1e-3, 1e3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_kernel_at_edge_scales(dtype, scale, eps):
    """The kernel against RMSNorm's float64 definition (not the reference, which could share a bug): inputs at
    1e-3 (eps then weighs like mean(x^2)) and 1e3, a zero row (zeros, not NaN). fp16 holds 1e-3 x N(0, 1) as
    subnormals at worst, so its rows are compared at fp16's tolerance."""
    from .test_reference import _edge_rows, _rms_norm_naive

    x = _edge_rows(64, scale, seed=11).to(dtype)
    w = (torch.rand(64, generator=torch.Generator().manual_seed(12)) + 0.5).to(dtype)
    got = rms_norm(x.to(DEVICE), w.to(DEVICE), eps).cpu().double()
    want = _rms_norm_naive(x.float(), w.float(), eps)
    atol, rtol = TOL[dtype]
    assert torch.isfinite(got).all() and (got[0, 1] == 0).all()
    torch.testing.assert_close(got, want, atol=atol * float(want.abs().max()), rtol=rtol)


@pytest.mark.usefixtures("_row_local_dot")
@pytest.mark.parametrize("config", LINEAR_CONFIGS, ids=LINEAR_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_invariance(dtype, config):
    """A row at M = 1, inside M = 74 and inside a [3, 74] batch: the same bits (split-K on and off)."""
    x, w = _rand(3, 74, 72, dtype=dtype, seed=5), _rand(40, 72, dtype=dtype, seed=6) * 0.1
    b = _rand(40, dtype=dtype, seed=7)
    batch = invariant_linear(x, w, b, config=config)
    wide = invariant_linear(x[1], w, b, config=config)
    for m in (0, 17, 73):
        alone = invariant_linear(x[1, m:m + 1], w, b, config=config)
        assert torch.equal(alone[0], wide[m]) and torch.equal(wide[m], batch[1, m])


@pytest.mark.usefixtures("_row_local_dot")
@pytest.mark.parametrize("config", [None, SMALL], ids=["table", "small"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_tiles_share_bits(dtype, config):
    """Each of a config's tiles, forced for every M, gives every row the same bits: the tile is chosen by M, so
    decode and verify launch different tiles. On CUDA at Llama-3-8B's q/k/v widths, split (N = 1024) and not (N =
    14336); under the interpreter with small shapes and the tensor cores' K-step order (``_row_local_dot``)."""
    cfg = config or InvariantConfig()
    shapes = [(40, 72), (40, 200)] if INTERPRET else [(1024, 4096), (14336, 4096), (4096, 14336)]
    for N, K in shapes:
        x, w = _rand(74, K, dtype=dtype, seed=10), _rand(N, K, dtype=dtype, seed=11) * K ** -0.5
        want = invariant_linear(x, w, None, config=cfg)
        for tile in cfg.linear_tiles:
            forced = dataclasses.replace(cfg, linear_tiles=(dataclasses.replace(tile, max_m=1 << 62),))
            assert torch.equal(invariant_linear(x, w, None, config=forced), want), (N, K, tile)
            assert torch.equal(invariant_linear(x[5:6], w, None, config=forced), want[5:6]), (N, K, tile)


def test_linear_tile_choice():
    cfg = InvariantConfig()
    assert [cfg.linear_tile(m).block_m for m in (1, 16, 17, 64, 65, 74, 4096)] == [16, 16, 64, 64, 128, 128, 128]
    with pytest.raises(ValueError, match="linear_tiles\\[1\\].block_k"):
        InvariantConfig(linear_tiles=(LinearTile(1, 16, 16), LinearTile(8, 16, 256)))
    with pytest.raises(ValueError, match="increasing max_m"):
        InvariantConfig(linear_tiles=(LinearTile(8, 16, 16), LinearTile(8, 16, 16)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_invariance(dtype):
    x, w = _rand(3, 74, 96, dtype=dtype, seed=8), _rand(96, dtype=dtype, seed=9)
    batch, wide = rms_norm(x, w, 1e-5), rms_norm(x[2], w, 1e-5)
    for m in (0, 40, 73):
        assert torch.equal(rms_norm(x[2, m:m + 1], w, 1e-5)[0], wide[m]) and torch.equal(wide[m], batch[2, m])


# Attention ----------------------------------------------------------------------------------------------------------
def _tree(B: int, shape: tuple[int, ...], seed: int):
    """A random tree of ``shape`` per row (parents before children): (ancestors, depths) on DEVICE."""
    spec = TreeSpec(shape)
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((B, spec.num_nodes), -1, dtype=torch.int64)
    for d in range(1, spec.depth + 1):
        lo, hi, plo = spec.offsets[d], spec.offsets[d + 1], spec.offsets[d - 1]
        parents[:, lo:hi] = torch.randint(plo, lo, (B, hi - lo), generator=g)
    anc, depths = tree_ancestors(tree_mask_from_parents(parents, spec))
    return anc.to(DEVICE), depths.to(DEVICE)


def _decode_equivalent(q, k, v, seqlens, anc, depths, b, m, config, scale=0.2):
    """Query m of row b as plain decoding computes it: its ancestors committed at rows N .. N + depth - 1 and its
    own K/V at row N + depth of a one-row cache, M = 1."""
    N, d = int(seqlens[b]), int(depths[b, m])
    kc, vc = k[b:b + 1].clone(), v[b:b + 1].clone()
    rows = N + anc[b, m, :d + 1].long()
    kc[0, N:N + d + 1], vc[0, N:N + d + 1] = k[b, rows], v[b, rows]
    zero = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
    lens = torch.tensor([N + d], dtype=torch.int32, device=q.device)
    return invariant_attn(q[b:b + 1, m:m + 1], kc, vc, lens, zero, zero[..., 0], scale, config=config)


# (shape, committed lengths): trees crossing split (32) and block (16) boundaries, an empty cache, a full split
ATTN_CASES = [((2, 2, 2), [29, 60]), ((3, 3), [0, 95]), ((1, 1, 1, 1, 1), [31, 64])]


@pytest.mark.parametrize("config", [None, SMALL], ids=["table", "small"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attn_matches_reference(dtype, heads, config):
    Hq, Hkv = heads
    anc, depths = _tree(2, (2, 3, 2), seed=1)
    M, D = anc.shape[1], 64
    q, k, v = _rand(2, M, Hq, D, dtype=dtype, seed=10), _rand(2, 128, Hkv, D, dtype=dtype, seed=11), \
        _rand(2, 128, Hkv, D, dtype=dtype, seed=12)
    seqlens = torch.tensor([45, 100], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, seqlens, anc, depths, 0.2)
    _check(invariant_attn(*args, config=config), ref.invariant_attn, args, dtype)


# float32 on every case, the 16-bit dtypes on the first (the interpreter is slow)
NODE_GRID = [(torch.float32, *c) for c in ATTN_CASES] + [(dt, *ATTN_CASES[0]) for dt in DTYPES if dt != torch.float32]


@pytest.mark.usefixtures("_row_local_dot")
@pytest.mark.parametrize("dtype,shape,lens", NODE_GRID)
def test_attn_tree_node_equals_decode(dtype, shape, lens):
    """Every node of a verified tree (M nodes, batch of 2) equals plain decoding at that token bit for bit."""
    anc, depths = _tree(2, shape, seed=sum(lens))
    M, Hq, Hkv, D = anc.shape[1], 4, 2, 64
    q, k, v = _rand(2, M, Hq, D, dtype=dtype, seed=13), _rand(2, 128, Hkv, D, dtype=dtype, seed=14), \
        _rand(2, 128, Hkv, D, dtype=dtype, seed=15)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out, lse = invariant_attn(q, k, v, seqlens, anc, depths, 0.2, config=SMALL)
    for b in range(2):
        for m in range(M):
            o1, l1 = _decode_equivalent(q, k, v, seqlens, anc, depths, b, m, SMALL)
            assert torch.equal(o1[0, 0], out[b, m]) and torch.equal(l1[0, :, 0], lse[b, :, m]), (b, m)


@pytest.mark.usefixtures("_row_local_dot")
def test_attn_wide_tree_with_the_table_config():
    """A 74-row tree (the 4-16-16-16-16 tree after 5 re-fed slots' worth of width) under the default config."""
    anc, depths = _tree(1, (4, 16, 16, 16, 16, 4), seed=3)
    M, Hq, Hkv, D = anc.shape[1], 4, 1, 64
    dtype = torch.float16
    q, k, v = _rand(1, M, Hq, D, dtype=dtype, seed=16), _rand(1, 300, Hkv, D, dtype=dtype, seed=17), \
        _rand(1, 300, Hkv, D, dtype=dtype, seed=18)
    seqlens = torch.tensor([200], dtype=torch.int32, device=DEVICE)
    out, lse = invariant_attn(q, k, v, seqlens, anc, depths, 0.2)
    for m in (0, 3, 20, 57, M - 1):
        o1, l1 = _decode_equivalent(q, k, v, seqlens, anc, depths, 0, m, None)
        assert torch.equal(o1[0, 0], out[0, m]) and torch.equal(l1[0, :, 0], lse[0, :, m]), m
