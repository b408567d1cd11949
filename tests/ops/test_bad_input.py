"""Bad input gets a clear error naming the argument and the expectation, through the raw ops and the wrappers."""
from __future__ import annotations

import pytest
import torch

import longspec_ops

ops = torch.ops.longspec
B, M, N, Hq, Hkv, D = 2, 3, 10, 4, 2, 8


def _args(**over):
    a = dict(
        q=torch.randn(B, M, Hq, D),
        k_cache=torch.randn(B, N, Hkv, D),
        v_cache=torch.randn(B, N, Hkv, D),
        cache_seqlens=torch.tensor([10, 4], dtype=torch.int32),
        k_tree=torch.randn(B, M, Hkv, D),
        v_tree=torch.randn(B, M, Hkv, D),
        tree_mask=torch.ones(B, M, M, dtype=torch.bool),
        scale=0.3,
    )
    a.update(over)
    return a


def _hybrid(**over):
    a = _args(**over)
    return ops.hybrid_tree_attn(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["k_tree"], a["v_tree"],
                                a["tree_mask"], a["scale"])


@pytest.mark.parametrize(
    "over,match",
    [
        ({"q": torch.randn(B, M, Hq)}, r"q must be 4-D \[B, M, Hq, D\]"),
        ({"q": torch.randn(B, M, Hq, D).to(torch.int32)}, "q must be float16, bfloat16, float32 or float64"),
        ({"k_cache": torch.randn(B, N, Hkv, D, dtype=torch.float64)}, "k_cache must have q's dtype"),
        ({"q": torch.randn(B, M, 5, D)}, r"head count \(5\) must be a multiple of k_cache's head count \(2\)"),
        ({"v_cache": torch.randn(B, N + 1, Hkv, D)}, "k_cache and v_cache must have one shape"),
        ({"k_cache": torch.randn(B, N, Hkv, 4), "v_cache": torch.randn(B, N, Hkv, 4)}, "head dim"),
        ({"tree_mask": torch.ones(B, M, M + 1, dtype=torch.bool)}, r"tree_mask must have shape \[B, M, K\]"),
        ({"tree_mask": torch.ones(B, M, M, dtype=torch.int64)}, "tree_mask must be bool"),
        ({"cache_seqlens": torch.tensor([11, 0], dtype=torch.int32)}, r"cache_seqlens values must lie in \[0, 10\]"),
        ({"cache_seqlens": torch.tensor([-1, 0], dtype=torch.int32)}, r"cache_seqlens values must lie in \[0, 10\]"),
        ({"cache_seqlens": torch.tensor([1.0, 2.0])}, "cache_seqlens must be int32"),
        ({"cache_seqlens": torch.tensor([1, 2, 3], dtype=torch.int32)}, r"cache_seqlens must have shape \[B\]"),
        # K = M + 1 tree keys are fine; the mask must then have K columns
        ({"k_tree": torch.randn(B, M + 1, Hkv, D), "v_tree": torch.randn(B, M + 1, Hkv, D)},
         r"tree_mask must have shape \[B, M, K\] = \(2, 3, 4\)"),
        ({"scale": 0.0}, "scale must be a finite positive float"),
        ({"q": torch.randn(B, M, Hq, 2 * D)[..., ::2]}, "q must have a contiguous last dimension"),
        ({"k_tree": torch.randn(B, M, Hkv, D, device="meta")}, "all tensors must be on one device"),
    ],
)
def test_hybrid_rejects(over, match):
    with pytest.raises(ValueError, match=match):
        _hybrid(**over)


def test_prefix_rejects_per_query_shape_and_long_lengths():
    q, kc = torch.randn(B, M, Hq, D), torch.randn(B, N, Hkv, D)
    with pytest.raises(ValueError, match=r"kv_lens must have shape \[B\] or \[B, M\]"):
        ops.prefix_attn(q, kc, kc, torch.zeros(B, M + 1, dtype=torch.int32), 0.3)
    with pytest.raises(ValueError, match=r"kv_lens values must lie in \[0, 10\]"):
        longspec_ops.prefix_attn(q, kc, kc, torch.full((B, M), 12, dtype=torch.int32))


def test_tree_and_merge_reject():
    q, k = torch.randn(B, M, Hq, D), torch.randn(B, M, Hkv, D)
    with pytest.raises(ValueError, match="tree_mask must be 3-D"):
        ops.tree_attn(q, k, k, torch.ones(M, M, dtype=torch.bool), 0.3)
    out, lse = torch.randn(B, M, Hq, D), torch.randn(B, Hq, M)
    with pytest.raises(ValueError, match="lse_b must be float32"):
        ops.merge_attn_states(out, lse, out, lse.double())
    with pytest.raises(ValueError, match=r"lse_a must have shape \[B, H, M\]"):
        ops.merge_attn_states(out, lse.transpose(1, 2), out, lse)


def test_draft_cross_rejects_bad_positions():
    q, kc = torch.randn(B, M, Hq, D), torch.randn(B, N, Hkv, D)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q_pos must have shape \[B, M\]"):
        ops.draft_cross_attn(q, kc, kc, torch.zeros(B, dtype=torch.int32), lens, 0.3)


def test_commit_rejects_and_loses_nothing():
    kv = torch.randn(4, B, N, Hkv, D)
    before = kv.clone()
    lens = torch.tensor([8, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="reaches row 10, beyond the cache's 10 rows"):
        ops.commit_kv_(kv, lens, torch.tensor([[0, 2], [0, 1]], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"accept_lens values must lie in \[0, 2\]"):
        ops.commit_kv_(kv, lens, torch.zeros(B, 2, dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        ops.commit_kv_(kv.transpose(3, 4), lens, torch.zeros(B, 2, dtype=torch.int32), torch.ones(B, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_cache must be 5-D"):
        ops.commit_kv_(kv[0], lens, torch.zeros(B, 2, dtype=torch.int32), torch.ones(B, dtype=torch.int32))
    assert torch.equal(kv, before)  # a rejected call leaves the cache untouched


def test_invariant_ops_reject():
    a = _args()
    anc = torch.zeros(B, M, 2, dtype=torch.int32)
    dep = torch.zeros(B, M, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"ancestors must have shape \[B, M, A\]"):
        ops.invariant_attn(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], anc[:, :1], dep, 0.3)
    with pytest.raises(ValueError, match="depths must be int32"):
        ops.invariant_attn(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], anc, dep.float(), 0.3)
    with pytest.raises(ValueError, match=r"depths values must lie in \[0, 1\]"):
        ops.invariant_attn(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], anc, dep + 2, 0.3)
    with pytest.raises(ValueError, match="beyond the cache's 10 rows"):
        ops.invariant_attn(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], anc + 1, dep, 0.3)
    x = torch.randn(B, M, 8)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = x's last dimension \(8\)"):
        longspec_ops.invariant_linear(x, torch.randn(4, 6))
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        longspec_ops.invariant_linear(x, torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bias must be torch.float32 \[N\]"):
        longspec_ops.invariant_linear(x, torch.randn(4, 8), torch.randn(5))
    with pytest.raises(ValueError, match=r"weight must be \[H\] with H = x's last dimension"):
        longspec_ops.rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match="eps must be a finite float >= 0"):
        longspec_ops.rms_norm(x, torch.randn(8), -1.0)


def test_prompt_lookup_chain_bad_input():
    tokens, lens = torch.randint(0, 5, (2, 9)), torch.tensor([8, 3], dtype=torch.int32)
    cases = [
        ((tokens.int(), lens, 4, 1, 3), "tokens must be int64"),
        ((tokens[0], lens, 4, 1, 3), r"tokens must be 2-D \[B, C\]"),
        ((tokens, lens.float(), 4, 1, 3), "seqlens must be an int32"),
        ((tokens, lens[:1], 4, 1, 3), r"seqlens must have shape \[B\] = \(2,\)"),
        ((tokens, lens, 0, 1, 3), "depth must be >= 1"),
        ((tokens, lens, 4, 3, 2), "need 1 <= min_ngram <= max_ngram"),
        ((tokens, torch.tensor([9, 3], dtype=torch.int32), 4, 1, 3),
         r"seqlens values must lie in \[0, 8\] \(the root's column: tokens has 9 columns\)"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.prompt_lookup_chain(*args)
        with pytest.raises(ValueError, match=match):
            longspec_ops.prompt_lookup_chain(*args)


def test_record_acceptance_bad_input():
    B, T, K, A, cells = 2, 5, 3, 4, 20

    def args(**over):
        a = dict(proposed=torch.zeros(cells), accepted=torch.zeros(cells), realised=torch.ones(K),
                 mass=torch.zeros(K), seen=torch.zeros(K, dtype=torch.bool),
                 keys=torch.zeros(B, T, dtype=torch.int64), within=torch.zeros(B, T, K),
                 contained=torch.zeros(K, dtype=torch.bool), accept_index=torch.zeros(B, A, dtype=torch.int64),
                 accept_len=torch.ones(B, dtype=torch.int64), active=torch.ones(B, dtype=torch.bool),
                 decay=0.99, rate=0.2)
        a.update(over)
        return list(a.values())

    ops.record_acceptance_(*args())  # well-formed
    for over, match in (({"seen": torch.zeros(K)}, "seen must be torch.bool"),
                        ({"mass": torch.zeros(K + 1)}, r"mass must have realised's shape \[K\] = \(3,\)"),
                        ({"within": torch.zeros(B, T, K + 1)}, r"within must have shape \[2, 5, 3\]"),
                        ({"keys": torch.zeros(B, T, dtype=torch.int32)}, "keys must be torch.int64"),
                        ({"proposed": torch.zeros(cells, 2)[:, 0]}, "proposed must be contiguous"),
                        ({"rate": 0.0}, r"decay and rate must lie in \(0, 1\]"),
                        ({"keys": torch.full((B, T), cells, dtype=torch.int64)}, r"keys values must lie in \[0, 19\]"),
                        ({"accept_len": torch.full((B,), A + 1)}, r"accept_len values must lie in \[1, 4\]")):
        with pytest.raises(ValueError, match=match):
            ops.record_acceptance_(*args(**over))
