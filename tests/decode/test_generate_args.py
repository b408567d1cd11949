"""``SpeculativeDecoder.generate``: a bad sampling argument is a ValueError naming it (never a raw TypeError from a
conversion), and the stats report tokens per second."""
from __future__ import annotations

import pytest
import torch

from longspec import PromptLookupDrafter, SpeculativeDecoder

from .tiny_targets import tiny_target

IDS = torch.tensor([[5, 9, 13, 7, 5, 9]])


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=None), "temperature must be a finite number >= 0, got None"),
    (dict(temperature="0.7"), "temperature must be a finite number >= 0, got '0.7'"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(top_p=None), r"top_p must be in \(0, 1\], got None"),
    (dict(top_k=2.5), r"top_k must be an int >= 0 \(0 disables it\), got 2.5"),
    (dict(seed=-1), r"seed must be None or an int in \[0, 2\*\*64\), got -1"),
])
def test_bad_sampling_arguments_are_named(kwargs, message):
    decoder = SpeculativeDecoder(tiny_target("llama-gqa-d64"), None)
    with pytest.raises(ValueError, match=message):
        decoder.generate(IDS, 4, **kwargs)


def test_stats_report_tokens_per_second():
    stats = SpeculativeDecoder(tiny_target("llama-gqa-d64"), None).generate(IDS, 5, eos_token_id=[]).stats
    total = stats.time_prefill + stats.time_decode
    assert stats.generated_tokens == 5 and stats.tokens_per_s == pytest.approx(5 / total)
    assert f"tokens/s={stats.tokens_per_s:.1f} " in stats.summary()
    assert stats.time_draft is None and "verify=" not in stats.summary()  # phase times are opt-in


def test_phase_times_when_asked():
    dec = SpeculativeDecoder(tiny_target("llama-gqa-d64"), PromptLookupDrafter(), tree_shape=(2, 2), phase_times=True)
    stats = dec.generate(IDS, 6, eos_token_id=[]).stats
    assert min(stats.time_draft, stats.time_verify, stats.time_accept) > 0
    assert stats.time_draft + stats.time_verify + stats.time_accept <= stats.time_decode
    assert "draft=" in stats.summary() and "accept=" in stats.summary()
