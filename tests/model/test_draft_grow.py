"""widen_mlp: a wider draft that computes what the trained one did, learns with its new units, saves and loads at
its width, and drafts exactly."""
from __future__ import annotations

import pytest
import torch

from longspec import LongSpecDraft, LongSpecDrafter, SpeculativeDecoder
from longspec.model.draft_grow import widen_mlp

from ..decode.tiny_targets import assert_same_tokens, hf_greedy, ragged_batch
from ..decode.tiny_targets import tiny_target as decode_target
from .draft_reference import randomize, tiny_target


def _inputs(seed=5, heads_kv=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 160, (2, 9), generator=g)
    tk = torch.randn(2, 11, heads_kv, 16, generator=g, dtype=torch.float64)
    tv = torch.randn(2, 11, heads_kv, 16, generator=g, dtype=torch.float64)
    return ids, tk, tv


def test_widened_draft_computes_the_same_function_and_leaves_the_original():
    target = tiny_target("llama", (4, 2)).double()
    draft = LongSpecDraft.from_target(target, window=5)
    randomize(draft)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    old = draft.config.intermediate_size
    wide = widen_mlp(draft, old + 40, seed=1)
    assert wide.config.intermediate_size == old + 40 and draft.config.intermediate_size == old
    assert wide.mlp.gate_proj.weight.shape == (old + 40, 64) and wide.mlp.down_proj.weight.shape == (64, old + 40)
    assert wide.dtype == torch.float64 and not wide.training and wide.target is target
    assert torch.equal(wide.mlp.down_proj.weight[:, old:], torch.zeros(64, 40, dtype=torch.float64))
    fresh = wide.mlp.up_proj.weight[old:]
    assert 0.5 * wide.config.initializer_range < fresh.std() < 2 * wide.config.initializer_range
    assert all(torch.equal(before[k], v) for k, v in draft.state_dict().items())  # the original is untouched
    ids, tk, tv = _inputs()
    with torch.no_grad():
        want, got = draft.logits(draft(ids, tk, tv, delta=2)), wide.logits(wide(ids, tk, tv, delta=2))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # the new units learn: their down columns get gradients at once
    wide.train()
    wide.logits(wide(ids, tk, tv)).logsumexp(-1).sum().backward()
    assert wide.mlp.down_proj.weight.grad[:, old:].abs().sum() > 0


def test_widened_draft_saves_and_loads_at_its_width(tmp_path):
    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target).set_draft_vocab(torch.tensor([3, 8, 99]))
    randomize(draft)
    wide = widen_mlp(draft, draft.config.intermediate_size * 2)
    assert wide.draft_vocab.tolist() == [3, 8, 99]
    wide.save_pretrained(tmp_path / "wide")
    again = LongSpecDraft.from_pretrained(tmp_path / "wide", target=target)
    assert again.config.intermediate_size == wide.config.intermediate_size
    assert again.draft_vocab.tolist() == [3, 8, 99]
    ids, tk, tv = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(again.logits(again(ids, tk.float(), tv.float())),
                                   wide.logits(wide(ids, tk.float(), tv.float())), atol=0, rtol=0)


@pytest.mark.parametrize("bad", [0, 128, 100, 300.0, True, "256"])
def test_bad_width_is_refused(bad):
    draft = LongSpecDraft.from_target(tiny_target("llama", (4, 2)))
    assert draft.config.intermediate_size == 128
    with pytest.raises(ValueError, match=r"intermediate_size must be an int larger than the draft's \(128\), got"):
        widen_mlp(draft, bad)


def test_widened_draft_decodes_exactly():
    """The drafting path (packed gate/up projections, the fused down projection) at a width the target does not
    have: greedy output equals the target's own."""
    target = decode_target("llama-gqa-d64")
    torch.manual_seed(0)
    draft = widen_mlp(LongSpecDraft.from_target(target), 3 * target.config.intermediate_size)
    ids, mask = ragged_batch([25, 14], seed=3, period=6)
    want, scores = hf_greedy(target, ids, mask, 16)
    out = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(4, 4, 4)).generate(ids, 16,
                                                                                            attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
