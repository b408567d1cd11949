"""The shipped trained pair: size, loading, held-out prompts from this machine's stdlib, and exact decoding."""
from __future__ import annotations


import pytest
import torch

from longspec.pretrained import PAIR_DIR, heldout_stdlib_prompt, load_code_pair
from longspec.train.corpus import is_heldout


@pytest.fixture(scope="module")
def pair():
    return load_code_pair("cpu", torch.float32)


def test_the_pair_ships_in_under_40_mb_and_loads(pair):
    total = sum(f.stat().st_size for f in PAIR_DIR.rglob("*") if f.is_file())
    assert total <= 40e6, total
    cfg = pair.target.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (256, 16, 8192)
    assert len(pair.tokenizer) == cfg.vocab_size and pair.tokenizer.eos_token_id == 0
    # the draft borrows the target's embedding and LM head: its own weights are one block (and the fc)
    assert all(cfg.vocab_size not in p.shape for p in pair.draft.parameters())
    assert pair.info["target"]["params"] == sum(p.numel() for p in pair.target.parameters())
    assert next(pair.draft.parameters()).dtype == torch.float32  # the target's dtype


def test_heldout_prompt_comes_from_a_heldout_stdlib_package(pair):
    ids, package = heldout_stdlib_prompt(pair.tokenizer, 512, seed=3)
    assert ids.shape == (1, 512) and ids.dtype == torch.long
    assert is_heldout(package, pair.info["heldout_frac"])
    text = pair.tokenizer.decode(ids[0])
    assert f"# file: {package}" in text
    again, _ = heldout_stdlib_prompt(pair.tokenizer, 512, seed=3)
    assert torch.equal(ids, again)
    with pytest.raises(ValueError, match="held-out package"):
        heldout_stdlib_prompt(pair.tokenizer, 10**8)


def test_the_trained_draft_is_exact_and_accepts_on_heldout_code(pair):
    from longspec import LongSpecDrafter, SpeculativeDecoder

    ids, _ = heldout_stdlib_prompt(pair.tokenizer, 768, seed=1)
    plain = SpeculativeDecoder(pair.target, None).generate(ids, 40, eos_token_id=[])
    spec = SpeculativeDecoder(pair.target, LongSpecDrafter(pair.draft), tree_shape=(4, 16, 16, 16, 16)).generate(
        ids, 40, eos_token_id=[])
    assert torch.equal(plain.sequences, spec.sequences)
    # A trained draft, unlike a random one, gets tokens accepted (tau 2.8-5.3 on repository prompts at 4k-64k).
    assert spec.stats.tau > 1.3, spec.stats.tau  # 4.9 here (wsgiref); an untrained draft gives about 1


def test_missing_pair_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trained pair"):
        load_code_pair("cpu", path=tmp_path)
