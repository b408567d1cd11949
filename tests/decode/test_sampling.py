"""Logits processing (against transformers' warpers) and the counter-based Gumbel noise."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import kstest
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from longspec.decode.sampling import SamplingParams, gumbel_noise, noise_key, process_logits, sample_tokens


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9)])
def test_processing_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 3, 101, generator=torch.Generator().manual_seed(1)) * 3
    logits[0, 0, :10] = 2.0  # ties at the top-k boundary are kept, as in transformers
    got = process_logits(logits, SamplingParams(temperature, top_k, top_p))
    flat = logits.reshape(-1, 101)
    want = TemperatureLogitsWarper(temperature)(None, flat)
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1.0:
        want = TopPLogitsWarper(top_p)(None, want)
    want = torch.log_softmax(want, dim=-1).reshape_as(logits)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite])


def test_tiny_temperature_is_greedy():
    logits = torch.randn(2, 5, 33, generator=torch.Generator().manual_seed(2))
    pos = torch.zeros(2, 5, dtype=torch.int64)
    for t in (0.0, 1e-6):
        assert torch.equal(sample_tokens(logits, SamplingParams(t, 3, 0.5, seed=1), pos), logits.argmax(-1))


def test_gumbel_noise_is_keyed_not_stateful():
    rows, pos = torch.tensor([0, 1, 2]), torch.tensor([[10, 11], [10, 11], [10, 11]])
    a = gumbel_noise(123, rows, pos, 64)
    assert torch.equal(a, gumbel_noise(123, rows, pos, 64))  # same key, same noise
    # a row's noise does not depend on the other rows in the batch
    assert torch.equal(a[1:2], gumbel_noise(123, rows[1:2], pos[1:2], 64))
    assert not torch.equal(a[0], a[1])  # rows differ
    assert not torch.equal(a[:, 0], a[:, 1])  # positions differ
    assert not torch.equal(a, gumbel_noise(124, rows, pos, 64))  # seeds differ
    assert not torch.equal(a, gumbel_noise(123 + 2**32, rows, pos, 64))  # high seed bits count
    assert torch.isfinite(a).all()
    # the seed as data (what compiled tails take) is the same noise
    assert torch.equal(a, gumbel_noise(noise_key(123, 64), rows, pos, 64))
    assert torch.equal(gumbel_noise(2**63 + 5, rows, pos, 64), gumbel_noise(noise_key(2**63 + 5, 64), rows, pos, 64))


def test_gumbel_noise_is_gumbel_distributed():
    g = gumbel_noise(7, torch.arange(64), torch.arange(64)[:, None] * 3, 4096).flatten()
    assert kstest(g.numpy(), "gumbel_r").pvalue > 1e-3
    u = torch.exp(-torch.exp(-g))  # back to uniforms: no obvious low-bit structure between neighbours
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


def test_seeded_sampling_follows_the_processed_distribution():
    """Across many (row, position) keys, seeded draws hit each token with its processed probability."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.95, seed=31)
    n_rows, n_pos = 500, 200
    draws = sample_tokens(logits.expand(n_rows, n_pos, 6), params, torch.arange(n_pos).expand(n_rows, n_pos))
    freq = torch.bincount(draws.flatten(), minlength=6).double() / draws.numel()
    p = process_logits(logits, params).exp().double()
    assert float(freq[p == 0].sum()) == 0.0
    assert torch.allclose(freq, p, atol=5 * float((p * (1 - p) / draws.numel()).sqrt().max()))


def test_sampling_params_errors():
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(float("nan"))
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        SamplingParams(1.0, top_k=1.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(1.0, top_p=1.5)
    with pytest.raises(ValueError, match="seed must be None or an int"):
        SamplingParams(1.0, seed=2**64)


# --- boundary cases: where a strict and a non-strict comparison part, random logits never land -------------------
_NEG = float("-inf")


def _warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1.0:
        want = TopPLogitsWarper(top_p)(None, want)
    return torch.isfinite(want)


@pytest.mark.parametrize("logits,top_k,top_p,kept", [
    # four tokens of mass exactly 1/4: the cumulative mass lands exactly on 1 - top_p = 1/2 after two of them,
    # and those two (the boundary included) are dropped, as transformers' `cumulative <= 1 - top_p` drops them
    ([0.0, 0.0, 0.0, 0.0, _NEG, _NEG, _NEG, _NEG], 0, 0.5, 2),
    ([0.0] * 8, 0, 0.75, 6),  # all equal: 1 - top_p = 2/8 exactly
    ([5.0, 3.0, 3.0, 3.0, 1.0, 0.0], 2, 1.0, 4),  # ties at the k-th logit are all kept
    ([1.0] * 6, 3, 1.0, 6),  # all equal: every token ties with the k-th
    ([_NEG, _NEG, 7.0, _NEG], 2, 0.3, 1),  # a single finite logit survives every filter
    ([_NEG, 0.0, 0.0, _NEG], 1, 0.5, 1),  # top-k ties (2 kept) then top-p at its boundary: one left
], ids=["top_p-boundary", "top_p-all-equal", "top_k-ties", "top_k-all-equal", "single-finite", "both-boundaries"])
def test_boundary_cases_match_transformers_warpers(logits, top_k, top_p, kept):
    x = torch.tensor([logits])
    got = torch.isfinite(process_logits(x, SamplingParams(1.0, top_k, top_p)))
    want = _warped(x, 1.0, top_k, top_p)
    assert int(got.sum()) == int(want.sum()) == kept
    # on these small rows torch's sort keeps ties in order, so transformers keeps the same tokens
    assert torch.equal(got, want)


def test_boundary_ties_drop_the_lower_ids_first():
    """160 equal logits with top_p = 1/2: half are kept, like transformers (whose unstable sort keeps other ids
    among exact ties); longspec keeps the higher ids (a stable ascending sort drops the lower ones first), the same
    in plain and speculative sampling."""
    x = torch.zeros(1, 160)
    got = torch.isfinite(process_logits(x, SamplingParams(1.0, 0, 0.5)))
    assert int(got.sum()) == int(_warped(x, 1.0, 0, 0.5).sum()) == 80
    assert got[0, 80:].all() and not got[0, :80].any()


def test_boundary_filters_never_draw_a_dropped_token():
    """Seeded and generator draws over many keys from boundary cases: dropped tokens are never drawn and the kept
    ones are drawn uniformly (they have equal mass)."""
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, _NEG, _NEG, 0.0, 0.0])  # six tokens of mass 1/6
    n_rows, n_pos = 300, 100
    logits = x.expand(n_rows, n_pos, 8)
    pos = torch.arange(n_pos).expand(n_rows, n_pos)
    p = process_logits(x, SamplingParams(1.0, 0, 0.5)).exp()
    assert int((p > 0).sum()) == 3
    for params, gen in ((SamplingParams(1.0, 0, 0.5, seed=5), None),
                        (SamplingParams(1.0, 0, 0.5), torch.Generator().manual_seed(5))):
        draws = sample_tokens(logits, params, pos, generator=gen).flatten()
        freq = torch.bincount(draws, minlength=8).double() / draws.numel()
        assert float(freq[p == 0].sum()) == 0.0
        assert torch.allclose(freq[p > 0], torch.full((3,), 1 / 3, dtype=torch.float64), atol=0.01)
