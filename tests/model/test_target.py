"""The target adapter: the static cache, the registered attention routing, and the supported-model checks."""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from longspec import SpeculativeDecoder
from longspec.decode.drafter import TreeSpec
from longspec.decode.tree import tree_mask_from_parents, tree_positions
from longspec.model.target import (
    AttentionStep,
    StaticKVCache,
    check_generation_length,
    check_supported,
    forward_extend,
    forward_tree,
    lm_logits,
    longspec_attention,
    use_longspec_attention,
)

from ..decode.tiny_targets import ragged_batch, tiny_target


def test_cache_is_one_allocation_with_views():
    cache = StaticKVCache(3, 2, 16, 2, 8, torch.float32, "cpu")
    assert cache.kv.shape == (3, 2, 2, 16, 2, 8) and cache.kv.is_contiguous()
    assert cache.seqlens.dtype == torch.int32 and cache.seqlens.tolist() == [0, 0]
    assert cache.max_len == 16 and cache.num_layers == 3 and cache.batch_size == 2
    cache.key(1)[0, 3] = 1.0
    cache.value(2)[1, 5] = 2.0
    planes = cache.planes()
    assert planes.shape == (6, 2, 16, 2, 8) and planes.data_ptr() == cache.kv.data_ptr()
    assert planes[2, 0, 3].eq(1.0).all() and planes[5, 1, 5].eq(2.0).all()
    rows = torch.tensor([[4, 5], [0, 9]])
    k = torch.randn(2, 2, 2, 8)
    cache.write(0, rows, k, -k)
    assert torch.equal(cache.key(0)[1, 9], k[1, 1]) and torch.equal(cache.value(0)[0, 5], -k[0, 1])
    with pytest.raises(ValueError, match="StaticKVCache sizes must be positive"):
        StaticKVCache(0, 1, 1, 1, 1, torch.float32, "cpu")


def test_cache_from_config_reads_heads_and_head_dim():
    model = tiny_target("qwen3-gqa-d128")
    cache = StaticKVCache.from_config(model.config, 2, 10, torch.float32, "cpu")
    assert cache.kv.shape == (2, 2, 2, 10, 1, 128)


@pytest.mark.parametrize("family", ["llama-gqa-d64", "qwen2-mha-d128"])
def test_chunked_extend_matches_transformers_forward(family):
    """Prefill through forward_extend (two chunks, ragged rows left-aligned) = transformers' padded forward."""
    model = tiny_target(family)
    ids, mask = ragged_batch([70, 45], seed=2)
    want = model(ids, attention_mask=mask).logits  # [B, S, V], left-padded
    cache = StaticKVCache.from_config(model.config, 2, 80, torch.float32, "cpu")
    aligned = torch.stack([ids[0], torch.cat([ids[1, 25:], torch.zeros(25, dtype=torch.int64)])])
    with torch.inference_mode(), use_longspec_attention(model):
        first = forward_extend(model, cache, aligned[:, :40])
        cache.seqlens.fill_(40)
        second = forward_extend(model, cache, aligned[:, 40:])
        got = lm_logits(model, torch.cat([first, second], dim=1))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1, :45], want[1, 25:], rtol=1e-4, atol=1e-4)


def test_tree_forward_equals_each_root_to_node_path():
    """Logits at every tree node = transformers' logits at the end of prompt + that node's path."""
    model = tiny_target("mistral-mha-d64")
    spec = TreeSpec((2, 3, 2))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 192, (n,), generator=g) for n in (33, 20)]
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 3, 5], [-1, 0, 0, 2, 2, 1, 4, 4]])
    tokens = torch.randint(3, 192, (2, spec.num_nodes), generator=g)
    cache = StaticKVCache.from_config(model.config, 2, 64, torch.float32, "cpu")
    prompt = torch.zeros(2, 33, dtype=torch.int64)
    for b, p in enumerate(prompts):
        prompt[b, : len(p)] = p
    with torch.inference_mode(), use_longspec_attention(model):
        forward_extend(model, cache, prompt)
        cache.seqlens.copy_(torch.tensor([33, 20], dtype=torch.int32))
        mask = tree_mask_from_parents(parents, spec)
        got = lm_logits(model, forward_tree(model, cache, tokens, tree_positions(cache.seqlens, spec), mask))
    assert cache.seqlens.tolist() == [33, 20]  # forward_tree never commits
    for b, p in enumerate(prompts):
        for i in range(spec.num_nodes):
            path = [j for j in range(spec.num_nodes) if mask[b, i, j]]
            want = model(torch.cat([p, tokens[b, path]])[None]).logits[0, -1]
            torch.testing.assert_close(got[b, i], want, rtol=1e-4, atol=1e-4)


def test_attention_implementation_is_scoped_and_needs_a_step():
    model = tiny_target("llama-gqa-d64")
    before = model.config._attn_implementation
    SpeculativeDecoder(model, None).generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="needs a longspec_step"):
        q = torch.zeros(1, 4, 2, 64)
        longspec_attention(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None)
    with pytest.raises(RuntimeError, match="use_longspec_attention"):
        forward_extend(model, StaticKVCache.from_config(model.config, 1, 4, torch.float32, "cpu"),
                       torch.tensor([[5]]))
    assert AttentionStep.extend(StaticKVCache(1, 2, 8, 1, 4, torch.float32, "cpu"), 3).kv_lens.tolist() == \
        [[1, 2, 3], [1, 2, 3]]


def test_unsupported_architecture_is_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match=r"unsupported target architecture GPT2LMHeadModel \(model_type='gpt2'\)"):
        SpeculativeDecoder(gpt2, None)


def _tiny_llama(**extra) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, **extra)
    return LlamaForCausalLM(config)


def test_position_dependent_rope_is_refused():
    for rope in ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},):
        with pytest.raises(ValueError, match="rope_type='dynamic'"):
            check_supported(_tiny_llama(rope_parameters=rope))


def test_sliding_window_beyond_the_sequence_is_refused():
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, sliding_window=16, max_position_embeddings=128))
    check_generation_length(mistral, 16)  # inside the window attention is full attention: accepted
    with pytest.raises(ValueError, match=r"exceeds the model's sliding_window \(16\)"):
        SpeculativeDecoder(mistral, None).generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=13)
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings \(128\)"):
        check_generation_length(mistral, 129)
