"""A draft's RMSNorm epsilon is its target's: published Llama-3 targets use 1e-5, the draft config's default is 1e-6,
so a config path that drops ``rms_norm_eps`` would silently change every published draft's norms."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from longspec.model.draft import LongSpecDraft, LongSpecDraftConfig

from .draft_reference import DenseDraft, published_state_dict, tiny_target

LLAMA3_EPS = 1e-5  # Llama-3-8B's config.json
NORMS = ("input_layernorm", "post_self_attention_layernorm", "post_cross_attention_layernorm")


@pytest.fixture(scope="module")
def llama3_like():
    target = tiny_target("llama", (4, 2))
    target.config.rms_norm_eps = LLAMA3_EPS
    assert LongSpecDraftConfig().rms_norm_eps != LLAMA3_EPS  # else this file could not tell the two apart
    return target


def _norm_eps(draft) -> set[float]:
    return {getattr(draft, n).variance_epsilon for n in NORMS}


def test_a_fresh_draft_takes_its_targets_eps(llama3_like):
    assert LongSpecDraftConfig.from_target_config(llama3_like.config).rms_norm_eps == LLAMA3_EPS
    assert _norm_eps(LongSpecDraft.from_target(llama3_like)) == {LLAMA3_EPS}


def test_a_published_checkpoint_keeps_its_eps(llama3_like, tmp_path):
    """A published draft ships the target's config.json (model_type llama) next to its 20 tensors."""
    config = llama3_like.config.to_dict()
    assert config["rms_norm_eps"] == LLAMA3_EPS
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(published_state_dict(64, (4, 2), 128), str(tmp_path / "model.safetensors"))
    draft = LongSpecDraft.from_pretrained(tmp_path, target=llama3_like)
    assert draft.config.rms_norm_eps == LLAMA3_EPS and _norm_eps(draft) == {LLAMA3_EPS}


def test_a_saved_draft_reloads_with_its_eps(llama3_like, tmp_path):
    LongSpecDraft.from_target(llama3_like).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rms_norm_eps"] == LLAMA3_EPS
    assert _norm_eps(LongSpecDraft.from_pretrained(tmp_path, target=llama3_like)) == {LLAMA3_EPS}


def test_the_eps_reaches_the_output(llama3_like):
    """Against the float64 block built with the target's eps, on inputs small enough that eps matters."""
    draft = LongSpecDraft.from_target(llama3_like)
    draft.load_state_dict(published_state_dict(64, (4, 2), 128))
    dense = DenseDraft(draft, llama3_like)
    dense.eps = llama3_like.config.rms_norm_eps  # the truth comes from the target, not from the draft's config
    x = torch.full((1, 64), 2e-3, dtype=torch.float64)
    want = dense._norm(x, "input_layernorm")
    got = draft.input_layernorm(x.float()).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
