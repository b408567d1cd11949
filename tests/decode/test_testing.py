"""longspec.testing.first_divergence: locating where outputs part and how close to a tie that was."""
from __future__ import annotations

import torch

from longspec.testing import first_divergence

from .tiny_targets import ragged_batch, tiny_target


def test_equal_outputs_have_no_divergence():
    ids = torch.randint(3, 100, (2, 7))
    assert first_divergence(ids, ids.clone(), None) is None


def test_divergence_reports_the_reference_margin_on_the_agreed_prefix():
    model = tiny_target("llama-gqa-d64")
    ids, mask = ragged_batch([20, 13], seed=1)
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    got = want.clone()
    got[1, 22] = (got[1, 22] + 1) % 100 + 3  # row 1 parts at column 22 (the third generated token)
    d = first_divergence(got, want, model, mask)
    assert (d.row, d.column) == (1, 22)
    attn = torch.cat([mask[1:2], torch.ones(1, 2, dtype=mask.dtype)], dim=1)
    logits = model(want[1:2, :22], attention_mask=attn).logits[0, -1]
    top2 = logits.topk(2).values
    assert d.margin == float(top2[0] - top2[1]) and d.margin > 0


def test_first_difference_is_the_earliest_column_over_rows():
    from longspec.testing import first_difference

    want = torch.arange(12).view(2, 6)
    got = want.clone()
    assert first_difference(got, want) is None
    got[0, 4] = -1
    got[1, 2] = -1
    assert first_difference(got, want) == 2
    assert first_difference(want[:, :4], want) == 4  # a prefix: differs where the shorter one ends
