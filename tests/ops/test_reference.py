"""The CPU kernels (pure-PyTorch references) of every op against the naive float64 formulation, plus opcheck."""
from __future__ import annotations

import math

import pytest
import torch
from torch.library import opcheck

import longspec_ops
from longspec_ops.reference import attention as ref

from longspec.testing import beam_tree_mask

from .naive import hybrid_visibility, naive_attention

HEADS = [(4, 2), (6, 1), (4, 4)]
TOL = 1e-10  # float64 against float64


def _qkv(B, M, N, Hq, Hkv, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, M, Hq, D, generator=g, dtype=dtype)
    kc = torch.randn(B, N, Hkv, D, generator=g, dtype=dtype)
    vc = torch.randn(B, N, Hkv, D, generator=g, dtype=dtype)
    kt = torch.randn(B, M, Hkv, D, generator=g, dtype=dtype)
    vt = torch.randn(B, M, Hkv, D, generator=g, dtype=dtype)
    return q, kc, vc, kt, vt


def _close(out, lse, n_out, n_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.allclose(out.double(), n_out, atol=TOL, rtol=0)
    assert torch.equal(torch.isinf(lse), torch.isinf(n_lse))
    fin = torch.isfinite(n_lse)
    assert torch.allclose(lse.double()[fin], n_lse[fin], atol=1e-5, rtol=0)  # lse is float32 by contract


@pytest.mark.parametrize("Hq,Hkv", HEADS)
@pytest.mark.parametrize("B,M,N", [(1, 1, 1), (3, 5, 97), (2, 7, 0)])
def test_hybrid_matches_naive(B, M, N, Hq, Hkv):
    q, kc, vc, kt, vt = _qkv(B, M, N, Hq, Hkv, 16)
    lens = torch.randint(0, N + 1, (B,), dtype=torch.int32)
    mask = torch.rand(B, M, M, generator=torch.Generator().manual_seed(1)) < 0.5
    mask[0, 0] = False  # an empty tree row: with lens[0] = 0 its query sees nothing at all
    lens[0] = 0
    scale = 1 / math.sqrt(16)
    out, lse = longspec_ops.hybrid_tree_attn(q, kc, vc, lens, kt, vt, mask)
    keys = torch.cat([kc, kt], dim=1)
    vals = torch.cat([vc, vt], dim=1)
    n_out, n_lse = naive_attention(q, keys, vals, hybrid_visibility(lens, N, mask), scale)
    _close(out, lse, n_out, n_lse)
    assert (out[0, 0] == 0).all() and torch.isinf(lse[0, :, 0]).all()


def test_hybrid_beam_tree_and_strided_inputs():
    B, M, N, Hq, Hkv, D = 2, 21, 40, 4, 2, 8
    mask = beam_tree_mask((4, 16), B, torch.Generator().manual_seed(3))
    # transformers hands over [B, H, S, D]: pass transposed views, never copies
    q = torch.randn(B, Hq, M, D, dtype=torch.float64).transpose(1, 2)
    kc = torch.randn(B, Hkv, N, D, dtype=torch.float64).transpose(1, 2)
    vc = torch.randn(B, Hkv, N, D, dtype=torch.float64).transpose(1, 2)
    kt = torch.randn(B, Hkv, M, D, dtype=torch.float64).transpose(1, 2)
    vt = torch.randn(B, Hkv, M, D, dtype=torch.float64).transpose(1, 2)
    lens = torch.tensor([40, 13], dtype=torch.int32)
    out, lse = longspec_ops.hybrid_tree_attn(q, kc, vc, lens, kt, vt, mask, 0.3)
    vis = hybrid_visibility(lens, N, mask)
    n_out, n_lse = naive_attention(q, torch.cat([kc, kt], 1), torch.cat([vc, vt], 1), vis, 0.3)
    _close(out, lse, n_out, n_lse)


@pytest.mark.parametrize("K", [0, 13])
def test_hybrid_and_tree_with_more_tree_keys_than_queries(K):
    """A level of M = 4 queries over K tree keys (a drafter's level over all nodes so far), and no tree keys."""
    B, M, N, Hq, Hkv, D = 2, 4, 30, 4, 2, 8
    q, kc, vc, _, _ = _qkv(B, M, N, Hq, Hkv, D, seed=21)
    g = torch.Generator().manual_seed(22)
    kt, vt = torch.randn(B, K, Hkv, D, generator=g, dtype=torch.float64), torch.randn(B, K, Hkv, D, generator=g,
                                                                                        dtype=torch.float64)
    mask = torch.rand(B, M, K, generator=g) < 0.5
    lens = torch.tensor([30, 0], dtype=torch.int32)
    out, lse = longspec_ops.hybrid_tree_attn(q, kc, vc, lens, kt, vt, mask, 0.3)
    vis = hybrid_visibility(lens, N, mask)
    _close(out, lse, *naive_attention(q, torch.cat([kc, kt], 1), torch.cat([vc, vt], 1), vis, 0.3))
    out, lse = longspec_ops.tree_attn(q, kt, vt, mask, 0.3)
    _close(out, lse, *naive_attention(q, kt, vt, mask, 0.3))


@pytest.mark.parametrize("per_query", [False, True])
def test_prefix_matches_naive(per_query):
    B, M, N, Hq, Hkv, D = 3, 4, 33, 4, 2, 8
    q, kc, vc, _, _ = _qkv(B, M, N, Hq, Hkv, D, seed=5)
    shape = (B, M) if per_query else (B,)
    lens = torch.randint(0, N + 1, shape, dtype=torch.int32)
    out, lse = longspec_ops.prefix_attn(q, kc, vc, lens)
    lens_q = lens if per_query else lens[:, None].expand(B, M)
    vis = torch.arange(N)[None, None, :] < lens_q[:, :, None].long()
    _close(out, lse, *naive_attention(q, kc, vc, vis, 1 / math.sqrt(D)))


def test_query_blocking_matches_naive(monkeypatch):
    """Long query sets are attended in row blocks (bounded memory); results equal the one-shot naive formula."""
    monkeypatch.setattr(ref, "_LENGTH_BLOCK", 4)
    B, M, N, Hq, Hkv, D = 2, 11, 30, 4, 2, 8
    q, kc, vc, _, _ = _qkv(B, M, N, Hq, Hkv, D, seed=9)
    lens = (torch.arange(M, dtype=torch.int32)[None] + torch.tensor([[5], [19]], dtype=torch.int32))  # causal-style
    out, lse = longspec_ops.prefix_attn(q, kc, vc, lens)
    vis = torch.arange(N)[None, None, :] < lens[:, :, None].long()
    _close(out, lse, *naive_attention(q, kc, vc, vis, 1 / math.sqrt(D)))


def test_tree_matches_naive_with_empty_rows():
    B, M, Hq, Hkv, D = 2, 9, 6, 3, 8
    q, _, _, kt, vt = _qkv(B, M, 1, Hq, Hkv, D, seed=7)
    mask = torch.rand(B, M, M, generator=torch.Generator().manual_seed(8)) < 0.3
    mask[1, 4] = False
    out, lse = longspec_ops.tree_attn(q, kt, vt, mask, 0.2)
    _close(out, lse, *naive_attention(q, kt, vt, mask, 0.2))
    assert (out[1, 4] == 0).all() and torch.isinf(lse[1, :, 4]).all()


def test_draft_cross_visibility():
    B, M, N, Hq, Hkv, D = 2, 5, 20, 4, 2, 8
    q, kc, vc, _, _ = _qkv(B, M, N, Hq, Hkv, D, seed=9)
    seqlens = torch.tensor([12, 0], dtype=torch.int32)
    q_pos = torch.tensor([[10, 11, 12, 13, 14], [0, 1, 2, 3, 4]], dtype=torch.int32)
    out, lse = longspec_ops.draft_cross_attn(q, kc, vc, q_pos, seqlens)
    # re-fed tokens at t see rows < t; nodes past the root see rows < root (12); row 1 has no target rows yet
    want = torch.tensor([[10, 11, 12, 12, 12], [0, 0, 0, 0, 0]])
    vis = torch.arange(N)[None, None, :] < want[:, :, None]
    _close(out, lse, *naive_attention(q, kc, vc, vis, 1 / math.sqrt(D)))


def test_merge_is_exact_and_handles_empty_sides():
    B, M, H, D = 2, 3, 4, 8
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(B, 10, H, D, generator=g, dtype=torch.float64)
    vals = torch.randn(B, 10, H, D, generator=g, dtype=torch.float64)
    q = torch.randn(B, M, H, D, generator=g, dtype=torch.float64)
    split = torch.zeros(B, M, 10, dtype=torch.bool)
    split[..., :6] = True
    vis_a = split.clone()
    vis_b = ~split
    vis_a[0, 1] = False  # side a empty for one query
    vis_b[1, 2] = False  # side b empty for another
    vis_a[1, 0] = False
    vis_b[1, 0] = False  # both empty
    oa, la = naive_attention(q, keys, vals, vis_a, 0.5)
    ob, lb = naive_attention(q, keys, vals, vis_b, 0.5)
    out, lse = longspec_ops.merge_attn_states(oa, la.float(), ob, lb.float())
    n_out, n_lse = naive_attention(q, keys, vals, vis_a | vis_b, 0.5)
    assert not torch.isnan(out).any()
    assert torch.allclose(out, n_out, atol=1e-6)  # lse enters as float32
    assert torch.equal(torch.isinf(lse), torch.isinf(n_lse))
    assert (out[1, 0] == 0).all()


def test_commit_kv_moves_overlapping_rows():
    P, B, N, H, D = 4, 3, 16, 2, 4
    kv = torch.randn(P, B, N, H, D)
    before = kv.clone()
    seqlens = torch.tensor([2, 5, 0], dtype=torch.int32)
    idx = torch.tensor([[0, 2, 5, 9], [0, 1, 3, 0], [0, 4, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([4, 3, 0], dtype=torch.int32)
    longspec_ops.commit_kv_(kv, seqlens, idx, lens)
    want = before.clone()
    for b in range(B):
        for j in range(int(lens[b])):
            want[:, b, int(seqlens[b]) + j] = before[:, b, int(seqlens[b]) + int(idx[b, j])]
    assert torch.equal(kv, want)



def test_commit_kv_reference_skips_out_of_range_rows_like_the_kernel():
    """Lengths past A are clamped and rows whose source or destination leaves [0, N) are skipped (the CUDA
    kernel's rule, tests/ops/test_csrc_build.py), against a loop, on random and out-of-range values."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        B, N, A = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g)), 4
        kv = torch.randn(2, B, N, 1, 2, generator=g)
        seqlens = torch.randint(-2, N + 3, (B,), generator=g, dtype=torch.int32)
        idx = torch.randint(-3, N + 3, (B, A), generator=g, dtype=torch.int32)
        lens = torch.randint(0, A + 3, (B,), generator=g, dtype=torch.int32)
        want = kv.clone()
        for b in range(B):
            for j in range(min(int(lens[b]), A)):
                dst, src = int(seqlens[b]) + j, int(seqlens[b]) + int(idx[b, j])
                if 0 <= dst < N and 0 <= src < N:
                    want[:, b, dst] = kv[:, b, src]
        ref.commit_kv_(kv, seqlens, idx, lens)
        assert torch.equal(kv, want)


def test_commit_kv_reference_has_no_value_dependent_shapes():
    """It runs on the meta device (no boolean indexing, no host read), so as the CUDA fallback of a build without
    longspec_ops._C it can run inside a captured CUDA graph (the boolean-indexing version broke the capture)."""
    meta = dict(device="meta", dtype=torch.int32)
    ref.commit_kv_(torch.empty(2, 2, 8, 1, 4, device="meta"), torch.zeros(2, **meta), torch.zeros(2, 3, **meta),
                   torch.zeros(2, **meta))


def _sample_args():
    B, M, N, Hq, Hkv, D = 2, 3, 9, 4, 2, 8
    q, kc, vc, kt, vt = _qkv(B, M, N, Hq, Hkv, D, dtype=torch.float32, seed=13)
    lens = torch.tensor([9, 4], dtype=torch.int32)
    mask = torch.ones(B, M, M, dtype=torch.bool).tril()
    out_a, lse_a = ref.prefix_attn(q, kc, vc, lens, 0.3)
    out_b, lse_b = ref.tree_attn(q, kt, vt, mask, 0.3)
    kv = torch.randn(4, B, N, Hkv, D)
    return {
        "merge_attn_states": (out_a, lse_a, out_b, lse_b),
        "tree_attn": (q, kt, vt, mask, 0.3),
        "prefix_attn": (q, kc, vc, lens, 0.3),
        "hybrid_tree_attn": (q, kc, vc, lens, kt, vt, mask, 0.3),
        "draft_cross_attn": (q, kc, vc, torch.tensor([[3, 4, 5], [1, 2, 3]], dtype=torch.int32), lens, 0.3),
        "commit_kv_": (kv, torch.tensor([2, 3], dtype=torch.int32), torch.tensor([[0, 2], [0, 1]], dtype=torch.int32),
                       torch.tensor([2, 1], dtype=torch.int32)),
        "invariant_attn": (q, kc, vc, torch.tensor([5, 2], dtype=torch.int32), _chain_ancestors(B, M),
                           torch.tensor([[0, 1, 2], [0, 1, 1]], dtype=torch.int32), 0.3),
        "invariant_linear": (q.reshape(B, M, Hq * D), torch.randn(5, Hq * D), torch.randn(5)),
        "rms_norm": (q, torch.rand(D), 1e-6),
        "fused_linear": (q.reshape(B, M, Hq * D), torch.randn(10, Hq * D), torch.randn(10), torch.rand(Hq * D), 1e-6,
                         torch.randn(B, M, 5), True),
        "prompt_lookup_chain": (torch.randint(0, 3, (B, 12)), torch.tensor([11, 5], dtype=torch.int32), 4, 1, 3),
        "beam_topk": (torch.randn(B, M, 11), torch.randn(B, M), 5),
        "record_acceptance_": (torch.rand(40), torch.rand(40), torch.ones(5), torch.rand(5),
                               torch.tensor([True, False, True, False, False]), torch.randint(0, 40, (B, M)),
                               torch.rand(B, M, 5).round(), torch.tensor([True, True, False, True, False]),
                               torch.tensor([[0, 1], [0, 2]]), torch.tensor([2, 1]), torch.tensor([True, True]),
                               0.99, 0.2),
    }


def _chain_ancestors(B: int, M: int) -> torch.Tensor:
    return torch.arange(M, dtype=torch.int32).expand(B, M, M).contiguous()


@pytest.mark.parametrize("heads", HEADS)
def test_invariant_attn_against_naive(heads):
    """Query m sees rows [0, N) and its ancestors' rows N + anc[m, :depth + 1]: the naive full-mask softmax over
    those rows."""
    from longspec_ops.reference import invariant as inv

    Hq, Hkv = heads
    B, M, N, D = 2, 4, 20, 8
    q, kc, vc, _, _ = _qkv(B, M, N, Hq, Hkv, D, dtype=torch.float64, seed=7)
    seqlens = torch.tensor([9, 0], dtype=torch.int32)
    anc = torch.tensor([[[0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 2, 3]]] * 2, dtype=torch.int32)
    depths = torch.tensor([[0, 1, 1, 2]] * 2, dtype=torch.int32)
    visible = torch.zeros(B, M, N, dtype=torch.bool)
    for b in range(B):
        n = int(seqlens[b])
        visible[b, :, :n] = True
        for m in range(M):
            visible[b, m, n + anc[b, m, :int(depths[b, m]) + 1].long()] = True
    out, lse = inv.invariant_attn(q, kc, vc, seqlens, anc, depths, 0.3)
    o_n, l_n = naive_attention(q, kc, vc, visible, 0.3)
    assert (out - o_n).abs().max() < TOL and (lse.double() - l_n).abs().max() < 1e-5


def test_rms_norm_and_linear_against_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from longspec_ops.reference import invariant as inv

    x = torch.randn(3, 5, 16)
    norm = LlamaRMSNorm(16, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    assert torch.equal(inv.rms_norm(x, norm.weight.detach(), 1e-5), norm(x).detach())  # the same float32 ops
    x = x.double()
    w, b = torch.randn(7, 16, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    assert (inv.invariant_linear(x, w, b) - torch.nn.functional.linear(x, w, b)).abs().max() < TOL


def _edge_rows(H: int, scale: float, seed: int) -> torch.Tensor:
    """[3, 4, H] rows at ``scale`` (real activations reach 1e-3 and 1e3), one row of zeros and one far below the
    rest: the boundaries of an RMSNorm's condition, where eps decides the output."""
    x = torch.randn(3, 4, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    x[0, 1] = 0.0
    x[2, 3] *= 1e-3
    return x


def _rms_norm_naive(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm from its definition in float64: w * x / sqrt(mean(x^2) + eps), one row at a time."""
    out = torch.empty_like(x, dtype=torch.float64)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[:-1])):
        row = x[tuple(idx)].double()
        out[tuple(idx)] = w.double() * row / torch.sqrt((row * row).sum() / row.numel() + eps)
    return out


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_rms_norm_reference_at_edge_scales(scale, eps):
    """The reference against transformers' LlamaRMSNorm (bit for bit in float32 and bf16: the same ops) and against
    the float64 definition (at 1e-3 scale eps moves the output by ~1 / (1 + eps / mean(x^2)), so a reference that
    lost its eps fails here; a zero row must give zeros, not NaN)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from longspec_ops.reference import invariant as inv

    H = 48
    x64 = _edge_rows(H, scale, seed=int(scale * 1000) % 97)
    norm = LlamaRMSNorm(H, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=torch.Generator().manual_seed(3)) + 0.5)
    w = norm.weight.detach()
    for dtype in (torch.float32, torch.bfloat16):
        x = x64.to(dtype)
        got = inv.rms_norm(x, w.to(dtype), eps)
        assert torch.equal(got, norm.to(dtype)(x).detach()), dtype
        norm.float()
    got = inv.rms_norm(x64.float(), w, eps).double()
    want = _rms_norm_naive(x64.float(), w, eps)
    assert torch.isfinite(got).all() and torch.equal(got[0, 1], torch.zeros(H, dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_linear_reference_at_edge_scales(scale):
    """invariant_linear's reference against torch.nn.functional.linear in float64, at small and large inputs and
    weights (products near the float32 range's ends in the float32 accumulation) and with a zero row."""
    from longspec_ops.reference import invariant as inv

    x = _edge_rows(64, scale, seed=5)
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(24, 64, generator=g, dtype=torch.float64) * scale, torch.randn(24, generator=g,
                                                                                       dtype=torch.float64)
    want = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(inv.invariant_linear(x, w, b), want, rtol=1e-12, atol=0.0)
    got32 = inv.invariant_linear(x.float(), w.float(), b.float()).double()
    torch.testing.assert_close(got32, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(inv.invariant_linear(x.float(), w.float(), None)[0, 1], torch.zeros(24))


def test_prompt_lookup_chain_against_naive():
    """The longest n-gram (n <= 3) ending at the root, its latest earlier occurrence, the tokens after it (the text
    from the match to the root repeated past the root), found by Python loops over random rows."""
    from longspec_ops.reference import lookup

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 3, (40, 16), generator=g)
    seqlens = torch.randint(0, 16, (40,), generator=g, dtype=torch.int32)
    chain, found = lookup.prompt_lookup_chain(tokens, seqlens, 9, 1, 3)
    for b in range(40):
        ctx, p = tokens[b].tolist(), int(seqlens[b])
        want = [ctx[p]] * 10, False
        for n in (3, 2, 1):
            starts = [i + n for i in range(p - n + 1) if p >= n - 1 and ctx[i:i + n] == ctx[p - n + 1:p + 1]]
            if starts:
                s = max(starts)
                want = [ctx[p]] + [ctx[s + k % (p + 1 - s)] for k in range(9)], True
                break
        assert (chain[b].tolist(), bool(found[b])) == want, b


@pytest.mark.parametrize("P,V,width", [(1, 9, 4), (3, 7, 5), (4, 3, 12), (2, 50, 1)])
def test_beam_topk_against_naive(P, V, width):
    """The two-stage reference against one sort of all P * V pairs in float64 (score descending, then the lower
    (parent, column)), on tie-free scores; and on rows of equal logits, where only the tie order decides."""
    from longspec_ops.reference import beam

    g = torch.Generator().manual_seed(P * 100 + V)
    B = 3
    logits = torch.randn(B, P, V, generator=g, dtype=torch.float64).float()
    cum = torch.randn(B, P, generator=g)
    cum[2] = 0.0
    logits[2] = 1.5  # every pair of batch row 2 scores the same
    parent, column, score = beam.beam_topk(logits, cum, width)
    logp = torch.log_softmax(logits.double(), dim=-1)
    for b in range(B):
        pairs = sorted(((-(float(cum[b, p]) + float(logp[b, p, c])), p, c) for p in range(P) for c in range(V)))
        if b == 2:
            pairs = sorted(pairs, key=lambda t: (round(t[0], 6), t[1], t[2]))  # equal scores: (parent, column)
        want = pairs[:width]
        assert [(int(p), int(c)) for p, c in zip(parent[b], column[b])] == [(p, c) for _, p, c in want], b
        assert torch.allclose(score[b].double(), torch.tensor([-s for s, _, _ in want], dtype=torch.float64),
                              atol=1e-5)


def test_ordered_key_orders_like_the_floats():
    from longspec_ops.reference.beam import ordered_key

    x = torch.tensor([-float("inf"), -3.5, -1e-30, 0.0, 1e-30, 2.0, 2.0, float("inf")])
    keys = ordered_key(x, torch.arange(8))
    assert torch.equal(torch.sort(keys, descending=True).indices, torch.tensor([7, 5, 6, 4, 3, 2, 1, 0]))


@pytest.mark.parametrize("name", list(_sample_args()))
def test_opcheck(name):
    opcheck(getattr(torch.ops.longspec, name), _sample_args()[name])


def test_every_op_is_covered_by_opcheck():
    # the dispatcher's registry (dir(torch.ops.longspec) lists only the packets accessed so far); "_" = internal
    names = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("longspec::")}
    assert {n for n in names if not n.startswith("_")} == set(_sample_args())


@pytest.mark.parametrize("name", ["tree_attn", "prefix_attn", "hybrid_tree_attn", "merge_attn_states"])
def test_compiles_fullgraph(name):
    args = _sample_args()[name]
    op = getattr(torch.ops.longspec, name)
    fn = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")
    got = fn(*args)
    want = op(*args)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
