"""Property tests (hypothesis) of the CPU ops against the independent float64 formulation in ``naive.py``.

Random shapes, GQA ratios, head dims, cache lengths (0 and full drawn on purpose), per-query lengths, tree masks,
strided layouts (transformers' ``[B, H, S, D]`` as transposed views; every other row of a longer cache) and the
reference's query-block size; cache rows past the lengths hold NaN, which must never reach an output. Bad dtypes
and devices are refused with the argument named. Examples are derandomized and bounded, so CI is deterministic and
the file runs in seconds.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import longspec_ops
from longspec_ops.reference import attention as ref

from .naive import hybrid_visibility, naive_attention

PROPERTY = settings(max_examples=60, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}  # against float64; float32 accumulates over <= 24 keys
LAYOUTS = ("contiguous", "bhsd", "every-other-row")


@dataclass
class Case:
    B: int
    M: int
    N: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype
    layout: str
    seed: int
    block: int  # the reference's query-block size (_LENGTH_BLOCK)

    def qkv(self, key_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, M, Hq, D] and k, v [B, key_rows, Hkv, D], from the case's seed."""
        g = torch.Generator().manual_seed(self.seed)
        return self.tensor(g, self.M, self.Hq), self.tensor(g, key_rows, self.Hkv), self.tensor(g, key_rows, self.Hkv)

    def tensor(self, g: torch.Generator, rows: int, heads: int) -> torch.Tensor:
        """[B, rows, heads, D] in the case's layout (always a contiguous last dim)."""
        if self.layout == "bhsd":
            return torch.randn(self.B, heads, rows, self.D, generator=g, dtype=self.dtype).transpose(1, 2)
        if self.layout == "every-other-row":
            return torch.randn(self.B, 2 * rows, heads, self.D, generator=g, dtype=self.dtype)[:, ::2]
        return torch.randn(self.B, rows, heads, self.D, generator=g, dtype=self.dtype)


@st.composite
def cases(draw, min_m: int = 1) -> Case:
    Hkv = draw(st.integers(1, 3))
    return Case(B=draw(st.integers(1, 3)), M=draw(st.integers(min_m, 6)), N=draw(st.integers(0, 24)),
                Hq=Hkv * draw(st.sampled_from([1, 2, 4])), Hkv=Hkv, D=draw(st.sampled_from([4, 8, 16])),
                dtype=draw(st.sampled_from([torch.float64, torch.float32])), layout=draw(st.sampled_from(LAYOUTS)),
                seed=draw(st.integers(0, 2**31 - 1)), block=draw(st.sampled_from([1, 2, 5, 256])))


def lengths(draw, n: int, shape: tuple[int, ...]) -> torch.Tensor:
    """int32 lengths in [0, n], with 0 and the full n drawn often."""
    values = draw(st.lists(st.one_of(st.just(0), st.just(n), st.integers(0, n)), min_size=math.prod(shape),
                           max_size=math.prod(shape)))
    return torch.tensor(values, dtype=torch.int32).reshape(shape)


def masks(draw, c: Case) -> torch.Tensor:
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    return torch.rand(c.B, c.M, c.M, generator=torch.Generator().manual_seed(c.seed + 1)) < density


@contextmanager
def query_block(c: Case):
    with mock.patch.object(ref, "_LENGTH_BLOCK", c.block):
        yield


def poison_past(cache: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` [B, N, H, D] (same strides) with NaN in every row at or past ``held[b]``."""
    dirty = cache.clone()
    rows = torch.arange(cache.shape[1])[None, :] >= held.long()[:, None]
    dirty[rows] = float("nan")
    return dirty


def assert_matches(out, lse, visible, q, k, v, c: Case, scale: float) -> None:
    want_out, want_lse = naive_attention(q, k, v, visible, scale)
    assert out.dtype == c.dtype and lse.dtype == torch.float32
    assert out.shape == (c.B, c.M, c.Hq, c.D) and lse.shape == (c.B, c.Hq, c.M)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want_out, atol=TOL[c.dtype], rtol=0)
    assert torch.equal(lse.isinf(), want_lse.isinf())  # -inf exactly where a query sees no key
    finite = want_lse.isfinite()
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-5, rtol=1e-6)
    assert (out[~visible.any(-1)] == 0).all()


@PROPERTY
@given(c=cases(min_m=0), data=st.data())
def test_prefix_attn(c, data):
    q, k, v = c.qkv(c.N)
    per_query = data.draw(st.booleans())
    lens = lengths(data.draw, c.N, (c.B, c.M) if per_query else (c.B,))
    lens_q = lens if per_query else lens[:, None].expand(c.B, c.M)
    held = lens_q.amax(dim=1) if c.M else torch.zeros(c.B, dtype=torch.int32)
    with query_block(c):
        out, lse = longspec_ops.prefix_attn(q, poison_past(k, held), poison_past(v, held), lens)
    visible = torch.arange(c.N)[None, None, :] < lens_q[:, :, None].long()
    assert_matches(out, lse, visible, q, k, v, c, c.D**-0.5)


@PROPERTY
@given(c=cases(), data=st.data())
def test_hybrid_tree_attn(c, data):
    q, kc, vc = c.qkv(c.N)
    tree_keys = torch.Generator().manual_seed(c.seed + 2)
    kt, vt = c.tensor(tree_keys, c.M, c.Hkv), c.tensor(tree_keys, c.M, c.Hkv)
    lens, mask = lengths(data.draw, c.N, (c.B,)), masks(data.draw, c)
    with query_block(c):
        out, lse = longspec_ops.hybrid_tree_attn(q, poison_past(kc, lens), poison_past(vc, lens), lens, kt, vt, mask,
                                                 0.3)
    keys, values = torch.cat([kc, kt], dim=1), torch.cat([vc, vt], dim=1)
    assert_matches(out, lse, hybrid_visibility(lens, c.N, mask), q, keys, values, c, 0.3)


@PROPERTY
@given(c=cases(), data=st.data())
def test_tree_attn(c, data):
    q, k, v = c.qkv(c.M)
    mask = masks(data.draw, c)
    out, lse = longspec_ops.tree_attn(q, k, v, mask, 0.7)
    assert_matches(out, lse, mask, q, k, v, c, 0.7)


@PROPERTY
@given(c=cases(), data=st.data())
def test_draft_cross_attn(c, data):
    """Query i sees target rows [0, min(q_pos[b, i], cache_seqlens[b]))."""
    q, k, v = c.qkv(c.N)
    seqlens = lengths(data.draw, c.N, (c.B,))
    q_pos = torch.tensor(data.draw(st.lists(st.integers(-2, c.N + 3), min_size=c.B * c.M, max_size=c.B * c.M)),
                         dtype=torch.int32).reshape(c.B, c.M)
    with query_block(c):
        out, lse = longspec_ops.draft_cross_attn(q, poison_past(k, seqlens), poison_past(v, seqlens), q_pos, seqlens)
    visible = torch.arange(c.N)[None, None, :] < torch.minimum(q_pos, seqlens[:, None]).long()[:, :, None]
    assert_matches(out, lse, visible, q, k, v, c, c.D**-0.5)


@PROPERTY
@given(c=cases(), data=st.data())
def test_merge_attn_states_of_a_split_equals_the_whole(c, data):
    """Attention over a random split of the keys (either side possibly empty), merged, equals attention over all."""
    q, k, v = c.qkv(c.N)
    visible = masks_over(data.draw, c, c.N, 0.8)
    side_a = masks_over(data.draw, c, c.N, 0.5)
    out_a, lse_a = naive_attention(q, k, v, visible & side_a, 0.5)
    out_b, lse_b = naive_attention(q, k, v, visible & ~side_a, 0.5)
    out, lse = longspec_ops.merge_attn_states(out_a.to(c.dtype), lse_a.float(), out_b.to(c.dtype), lse_b.float())
    want, want_lse = naive_attention(q, k, v, visible, 0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)  # the lse enter as float32
    assert torch.equal(lse.isinf(), want_lse.isinf()) and not out.isnan().any()


def masks_over(draw, c: Case, n: int, density_max: float) -> torch.Tensor:
    density = draw(st.sampled_from([0.0, density_max / 2, density_max, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.rand(c.B, c.M, n, generator=torch.Generator().manual_seed(seed)) < density


@PROPERTY
@given(B=st.integers(1, 3), N=st.integers(1, 20), A=st.integers(0, 6), planes=st.integers(2, 4), data=st.data())
def test_commit_kv_(B, N, A, planes, data):
    """Rows seqlens + j receive rows seqlens + accept_index[j] (as they were before the call), j < accept_lens."""
    kv = torch.randn(planes, B, N, 2, 4, generator=torch.Generator().manual_seed(N * 7 + A))
    seqlens, idx, lens = [], [], []
    for _ in range(B):
        base = data.draw(st.integers(0, N - 1))
        room = N - base  # sources and destinations must stay inside the cache
        n = data.draw(st.integers(0, min(A, room)))
        sources = data.draw(st.lists(st.integers(0, room - 1), min_size=A, max_size=A))
        seqlens.append(base), lens.append(n), idx.append(sources)
    seqlens, lens = torch.tensor(seqlens, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    idx = torch.tensor(idx, dtype=torch.int32).reshape(B, A)
    before, want = kv.clone(), kv.clone()
    for b in range(B):
        for j in range(int(lens[b])):
            want[:, b, int(seqlens[b]) + j] = before[:, b, int(seqlens[b]) + int(idx[b, j])]
    longspec_ops.commit_kv_(kv, seqlens, idx, lens)
    assert torch.equal(kv, want)


# -- rejection: bad dtypes and devices are named -------------------------------------------------------------------

BAD_DTYPES = (torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64)


def _prefix_args(dtype=torch.float32):
    B, M, N, Hq, Hkv, D = 2, 3, 8, 4, 2, 8
    return dict(q=torch.randn(B, M, Hq, D, dtype=dtype), k_cache=torch.randn(B, N, Hkv, D, dtype=dtype),
                v_cache=torch.randn(B, N, Hkv, D, dtype=dtype), kv_lens=torch.tensor([8, 3], dtype=torch.int32))


@settings(max_examples=30, derandomize=True, database=None, deadline=None)
@given(name=st.sampled_from(["q", "k_cache", "v_cache"]), dtype=st.sampled_from(BAD_DTYPES + (torch.float16,)),
       base=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_a_bad_float_dtype_is_named(name, dtype, base):
    args = _prefix_args(base)
    args[name] = args[name].to(dtype)
    expected = {"q": "q must be float16, bfloat16, float32 or float64" if dtype in BAD_DTYPES else
                f"k_cache must have q's dtype {dtype}"}.get(name, f"{name} must have q's dtype {base}")
    with pytest.raises(ValueError, match=f"longspec.prefix_attn: {expected}"):
        torch.ops.longspec.prefix_attn(*args.values(), 0.3)


@settings(max_examples=20, derandomize=True, database=None, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool]),
       op=st.sampled_from(["prefix_attn", "hybrid_tree_attn"]))
def test_bad_length_dtypes_are_named(dtype, op):
    a = _prefix_args()
    lens = a["kv_lens"].to(dtype)
    B, M, _, D = a["q"].shape
    with pytest.raises(ValueError, match=f"longspec.{op}: (kv_lens|cache_seqlens) must be int32"):
        if op == "prefix_attn":
            torch.ops.longspec.prefix_attn(a["q"], a["k_cache"], a["v_cache"], lens, 0.3)
        else:
            tree = torch.randn(B, M, 2, D)
            torch.ops.longspec.hybrid_tree_attn(a["q"], a["k_cache"], a["v_cache"], lens, tree, tree,
                                                torch.ones(B, M, M, dtype=torch.bool), 0.3)


@settings(max_examples=20, derandomize=True, database=None, deadline=None)
@given(name=st.sampled_from(["q", "k_cache", "v_cache", "kv_lens"]))
def test_a_tensor_on_another_device_is_named(name):
    args = _prefix_args()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"longspec.prefix_attn: all tensors must be on one device, got .*{name} on "
                                         "meta"):
        torch.ops.longspec.prefix_attn(*args.values(), 0.3)
