"""LongSpecDraft: structure, the block's math against a dense float64 implementation, and checkpoint loading."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

from longspec.model.draft import PUBLISHED_TENSOR_NAMES, LongSpecDraft, LongSpecDraftConfig

from .draft_reference import DenseDraft, published_state_dict, randomize, tiny_target

LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}

# (target kind, (q heads, kv heads), rope parameters)
TARGETS = [
    ("llama", (4, 2), None),
    ("llama", (4, 4), LINEAR_ROPE),
    ("qwen2", (4, 2), None),
]


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama", (4, 2))


# --- structure ---------------------------------------------------------------------------------------------------


def test_published_names_and_no_borrowed_parameters(llama):
    draft = LongSpecDraft.from_target(llama)
    names = list(draft.state_dict())
    assert sorted(names) == sorted(PUBLISHED_TENSOR_NAMES) and len(names) == 20
    assert [n for n, _ in draft.named_children()] == [
        "input_layernorm", "self_attn", "post_self_attention_layernorm",
        "cross_attn", "post_cross_attention_layernorm", "mlp", "extra_blocks",
    ]  # fmt: skip
    assert len(draft.extra_blocks) == 0  # extra_cross_blocks defaults to 0: the method's one block
    target_params = {id(p) for p in llama.parameters()}
    assert not any(id(p) in target_params for p in draft.parameters())
    for attn in (draft.self_attn, draft.cross_attn):
        assert all(getattr(attn, f"{p}_proj").bias is not None for p in "qkv")
        assert attn.o_proj.bias is None
    assert draft.cross_attn.k_proj.weight.shape == (2 * 16, 64)  # GQA: Hkv * head_dim rows


@pytest.mark.parametrize("kind,heads,rope", TARGETS)
def test_config_from_target(kind, heads, rope):
    target = tiny_target(kind, heads, rope=rope)
    c = LongSpecDraftConfig.from_target_config(target.config)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, heads[0], heads[1], 16)
    assert (c.intermediate_size, c.hidden_act, c.window, c.vocab_size) == (128, "silu", 512, 160)
    assert c.rms_norm_eps == target.config.rms_norm_eps and c.mlp_bias is False


def test_fresh_init_follows_initializer_range(llama):
    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(llama)
    assert torch.equal(draft.input_layernorm.weight, torch.ones(64))
    assert torch.equal(draft.self_attn.q_proj.bias, torch.zeros(64))
    assert abs(draft.mlp.up_proj.weight.std().item() - llama.config.initializer_range) < 0.002


# --- the block's math -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,heads,rope", TARGETS)
@pytest.mark.parametrize("delta", [1, 3])
def test_forward_matches_dense_float64(kind, heads, rope, delta):
    """Causal window-W self-attention, cross-attention to target rows <= t - delta, SwiGLU, no final norm."""
    target = tiny_target(kind, heads, rope=rope)
    draft = LongSpecDraft.from_target(target, window=5)
    randomize(draft)
    g = torch.Generator().manual_seed(3)
    S, N = 14, 16
    ids = torch.randint(0, 160, (1, S), generator=g)
    tk, tv = torch.randn(1, N, heads[1], 16, generator=g), torch.randn(1, N, heads[1], 16, generator=g)
    with torch.no_grad():
        got = draft.logits(draft(ids, tk, tv, delta=delta))[0].double()
    want = DenseDraft(draft, target).sequence_logits(ids[0].tolist(), tk[0], tv[0], delta=delta)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_no_final_norm(llama):
    """The block's output goes to the target's LM head as is: no final norm (the target's model.norm is unused)."""
    draft = LongSpecDraft.from_target(llama)
    out = torch.randn(2, 3, 64)
    torch.testing.assert_close(draft.logits(out), llama.lm_head(out), rtol=0, atol=0)


def test_cross_kv_projections_never_run(llama):
    draft = LongSpecDraft.from_target(llama)

    def boom(*_):
        raise AssertionError("cross_attn.k_proj / v_proj must never be computed")

    handles = [draft.cross_attn.k_proj.register_forward_hook(boom), draft.cross_attn.v_proj.register_forward_hook(boom)]
    try:
        with torch.no_grad():
            draft(torch.randint(0, 160, (2, 6)), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16))
    finally:
        for h in handles:
            h.remove()


# --- checkpoints ------------------------------------------------------------------------------------------------


def _write_published(tmp_path, target, fmt: str, prefix: str, sd=None, config: dict | None = None):
    """A published-style draft directory: the target's config.json plus weights with the 20 names."""
    sd = sd if sd is not None else published_state_dict(64, (4, 2), 128)
    cfg = config if config is not None else target.config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    named = {prefix + k: v for k, v in sd.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(named, str(tmp_path / "model.safetensors"))
    else:
        torch.save(named, tmp_path / "draft_model_weights.pth")
    return sd


def _logits(draft, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 160, (2, 9), generator=g)
    tk, tv = torch.randn(2, 11, 2, 16, generator=g), torch.randn(2, 11, 2, 16, generator=g)
    with torch.no_grad():
        return draft.logits(draft(ids, tk, tv))


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
@pytest.mark.parametrize("prefix", ["", "model."])
def test_published_checkpoint_round_trip(tmp_path, llama, fmt, prefix):
    sd = _write_published(tmp_path, llama, fmt, prefix)
    draft = LongSpecDraft.from_pretrained(tmp_path, target=llama)
    for name, t in sd.items():
        assert torch.equal(draft.state_dict()[name], t), name
    assert draft.config.head_dim == 16 and draft.config.num_key_value_heads == 2
    reference = LongSpecDraft.from_target(llama)
    reference.load_state_dict(sd)
    logits = _logits(draft)
    assert torch.equal(logits, _logits(reference))
    # save_pretrained -> from_pretrained gives the same logits, bit for bit
    draft.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["config.json", "model.safetensors"]
    again = LongSpecDraft.from_pretrained(tmp_path / "saved", target=llama)
    assert torch.equal(_logits(again), logits)
    assert again.config.model_type == "longspec_draft"


def test_single_weights_file_without_config(tmp_path, llama):
    sd = published_state_dict(64, (4, 2), 128)
    torch.save({"model." + k: v for k, v in sd.items()}, tmp_path / "weights.pth")
    draft = LongSpecDraft.from_pretrained(tmp_path / "weights.pth", target=llama)
    assert torch.equal(draft.mlp.down_proj.weight, sd["mlp.down_proj.weight"])


def test_own_config_round_trips(tmp_path, llama):
    draft = LongSpecDraft.from_target(llama, window=7)
    draft.save_pretrained(tmp_path)
    again = LongSpecDraft.from_pretrained(tmp_path, target=llama)
    assert again.config.window == 7 and again.config.to_diff_dict() == draft.config.to_diff_dict()


def test_loads_in_the_targets_dtype(tmp_path):
    target = tiny_target("llama", (4, 2)).to(torch.bfloat16)
    _write_published(tmp_path, target, "safetensors", "")
    draft = LongSpecDraft.from_pretrained(tmp_path, target=target)
    assert all(p.dtype == torch.bfloat16 for p in draft.parameters())


def test_missing_and_unexpected_tensors_are_named(tmp_path, llama):
    sd = published_state_dict(64, (4, 2), 128)
    del sd["cross_attn.k_proj.bias"]
    sd["lm_head.weight"] = torch.zeros(160, 64)
    _write_published(tmp_path, llama, "safetensors", "", sd=sd)
    match = r"missing tensors: cross_attn\.k_proj\.bias.*unexpected tensors: lm_head\.weight"
    with pytest.raises(ValueError, match=match):
        LongSpecDraft.from_pretrained(tmp_path, target=llama)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, llama):
    sd = published_state_dict(64, (4, 2), 128)
    sd["self_attn.k_proj.weight"] = torch.zeros(64, 64)  # MHA-shaped k_proj for a GQA target
    _write_published(tmp_path, llama, "safetensors", "", sd=sd)
    with pytest.raises(ValueError, match=r"self_attn\.k_proj\.weight has shape \(64, 64\), expected \(32, 64\)"):
        LongSpecDraft.from_pretrained(tmp_path, target=llama)


def test_vocabulary_mismatch(tmp_path, llama):
    config = {**llama.config.to_dict(), "vocab_size": 32000}
    _write_published(tmp_path, llama, "safetensors", "", config=config)
    with pytest.raises(ValueError, match=r"vocab_size \(32000\) does not match the target's vocab_size \(160\)"):
        LongSpecDraft.from_pretrained(tmp_path, target=llama)


def test_hidden_size_mismatch(tmp_path, llama):
    other = tiny_target("llama", (4, 2), hidden=128)
    _write_published(tmp_path, other, "safetensors", "", sd=published_state_dict(128, (4, 2), 256))
    with pytest.raises(ValueError, match=r"hidden_size \(128\) does not match the target's hidden_size \(64\)"):
        LongSpecDraft.from_pretrained(tmp_path, target=llama)


class _Payload:
    ran = False

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    _Payload.ran = True
    return {}


def test_pth_is_loaded_weights_only(tmp_path, llama):
    """A pickle that would run code is refused, and the code does not run."""
    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump(_Payload(), f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        LongSpecDraft.from_pretrained(tmp_path / "evil.pth", target=llama)
    assert not _Payload.ran
