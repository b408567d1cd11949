"""The reduced drafting vocabulary: the draft scores only some rows of the target's LM head, proposes only those
tokens, saves and loads them beside its weights, and decoding stays exact."""
from __future__ import annotations

import pytest
import torch

from longspec import LongSpecDraft, LongSpecDrafter, SpeculativeDecoder
from longspec.model.draft_files import DRAFT_VOCAB_FILE, count_tokens, frequent_tokens, load_draft_vocab

from ..decode.tiny_targets import assert_same_tokens, hf_greedy, ragged_batch, tiny_target

FAMILY = "llama-gqa-d64"


def _draft(seed: int = 0) -> LongSpecDraft:
    torch.manual_seed(seed)
    return LongSpecDraft.from_target(tiny_target(FAMILY))


def test_frequent_tokens_and_counts():
    counts = count_tokens([torch.tensor([[3, 3, 5], [7, 3, 5]]), [7, 9]], 12)
    assert counts.tolist() == [0, 0, 0, 3, 0, 2, 0, 2, 0, 1, 0, 0]
    assert frequent_tokens(counts, 3).tolist() == [3, 5, 7]  # 5 and 7 tie at 2: both kept, sorted by id
    assert frequent_tokens(counts, 2).tolist() == [3, 5]  # the tie breaks to the lower id
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 12\)"):
        count_tokens([torch.tensor([12])], 12)
    with pytest.raises(ValueError, match=r"size must be an int in \[1, 12\]"):
        frequent_tokens(counts, 0)


def test_draft_logits_are_the_chosen_rows_of_the_full_head():
    draft = _draft()
    out = torch.randn(2, 3, draft.config.hidden_size)
    ids = torch.tensor([5, 17, 2, 100, 17])
    draft.set_draft_vocab(ids)
    assert draft.draft_vocab.tolist() == [2, 5, 17, 100] and draft.draft_vocab_size == 4
    torch.testing.assert_close(draft.draft_logits(out), draft.logits(out)[..., [2, 5, 17, 100]])
    assert draft.target_token_ids(torch.tensor([[3, 0]])).tolist() == [[100, 2]]
    draft.set_draft_vocab(None)
    assert draft.draft_vocab_size == draft.vocab_size and torch.equal(draft.draft_logits(out), draft.logits(out))


@pytest.mark.parametrize("bad,message", [
    (torch.tensor([[1, 2]]), "non-empty 1-D integer tensor"),
    (torch.tensor([], dtype=torch.int64), "non-empty 1-D integer tensor"),
    (torch.tensor([1.0, 2.0]), "non-empty 1-D integer tensor"),
    (torch.tensor([0, 192]), r"must lie in \[0, 192\)"),
    (torch.tensor([-1, 3]), r"must lie in \[0, 192\)"),
])
def test_bad_draft_vocab(bad, message):
    with pytest.raises(ValueError, match=message):
        _draft().set_draft_vocab(bad)


def test_reduced_vocab_drafts_only_its_tokens_and_decoding_stays_exact():
    target = tiny_target(FAMILY)
    ids, mask = ragged_batch([33, 20], seed=5, period=7)
    want, scores = hf_greedy(target, ids, mask, 20)
    # the tokens the target itself produces on this batch, plus some others: the draft can still be accepted
    vocab = torch.unique(torch.cat([want.flatten(), torch.arange(0, 192, 5)]))
    draft = _draft().set_draft_vocab(vocab)
    drafter = LongSpecDrafter(draft)
    proposed = []
    original = drafter.propose

    def spy(state, tree):
        out = original(state, tree)
        proposed.append(out.tokens[:, 1:].clone())
        return out

    drafter.propose = spy
    out = SpeculativeDecoder(target, drafter, tree_shape=(4, 4, 4)).generate(ids, 20, attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    assert proposed and torch.isin(torch.cat(proposed), vocab).all()


def test_tree_wider_than_the_reduced_vocab_is_refused():
    target = tiny_target(FAMILY)
    draft = _draft().set_draft_vocab(torch.tensor([1, 2, 3]))
    ids, mask = ragged_batch([10], seed=1)
    with pytest.raises(ValueError, match="tree level 1 asks for 4 nodes but its parents offer only 3 choices"):
        SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(4, 4)).generate(ids, 4, attention_mask=mask)


def test_draft_vocab_is_saved_beside_the_weights(tmp_path):
    target = tiny_target(FAMILY)
    draft = _draft().set_draft_vocab(torch.tensor([9, 4, 150]))
    draft.save_pretrained(tmp_path / "d")
    assert load_draft_vocab(tmp_path / "d" / DRAFT_VOCAB_FILE).tolist() == [4, 9, 150]
    again = LongSpecDraft.from_pretrained(tmp_path / "d", target=target)
    assert again.draft_vocab.tolist() == [4, 9, 150]
    LongSpecDraft.from_target(target).save_pretrained(tmp_path / "full")  # no vocabulary set: no file
    assert not (tmp_path / "full" / DRAFT_VOCAB_FILE).exists()
    assert LongSpecDraft.from_pretrained(tmp_path / "full", target=target).draft_vocab is None
    (tmp_path / "d" / DRAFT_VOCAB_FILE).write_text('{"ids": [1]}')
    with pytest.raises(ValueError, match="is not a drafting vocabulary"):
        LongSpecDraft.from_pretrained(tmp_path / "d", target=target)
