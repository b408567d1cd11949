"""Numerics.INVARIANT on a GPU in bf16: speculation changes no bit (issue 22).

* Kernels at model sizes: a row computed alone (M = 1), inside a 74-row call and inside a batch is bitwise equal
  (invariant_linear, rms_norm), and every node of a 69-node tree over a 32k cache equals plain decoding at that
  token (invariant_attn), bit for bit.
* End to end: the real layer geometry of Llama-3-8B, Qwen2.5-7B (GQA group 7, q/k/v biases), Qwen3-8B (q/k norms) and
  Mistral-7B with 2 random bf16 layers, contexts 4096 and 32768, T = 0 and seeded T = 1, prompt lookup and a
  random LongSpec draft's 4-16-16-16-16 tree: the output equals plain decoding in the same mode token for token over
  2 x 1024 generated tokens per case (random weights give near-uniform logits: near-ties everywhere, the hardest
  case for bitwise equality).

Run: ``PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python -m pytest -q tests/decode/test_gpu_invariant.py``.
"""
from __future__ import annotations

import pytest
import torch

from longspec import LongSpecDraft, LongSpecDrafter, Numerics, PromptLookupDrafter, SpeculativeDecoder

from ..conftest import requires_cuda
from ..ops.test_invariant_kernels import _decode_equivalent, _tree
from .tiny_targets import assert_same_tokens

pytestmark = requires_cuda

# (model_type, geometry): published configs' hidden / head / MLP / vocabulary sizes
SHAPES = {
    "Llama-3-8B": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                 num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0)),
    "Qwen2.5-7B": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                 num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0)),
    "Qwen3-8B": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0)),
    "Mistral-7B": ("mistral", dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0,
                                   sliding_window=None)),
}
LAYERS = 2
NEW_TOKENS = 1024  # per row; 2 rows: 2048 generated tokens per case


def _target(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, geometry = SHAPES[name]
    cfg = AutoConfig.for_model(model_type, **geometry, num_hidden_layers=LAYERS, max_position_embeddings=65536,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _prompts(context: int, vocab: int, seed: int = 0):
    """Two left-padded rows of ``context`` and ``context - 97`` tokens, a random 257-token block repeated (so that
    prompt lookup finds matches)."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(3, vocab, (257,), generator=g)
    row = block.repeat(context // 257 + 1)[:context]
    ids = torch.stack([row, torch.cat([torch.zeros(97, dtype=torch.int64), row[:context - 97]])])
    mask = torch.ones_like(ids)
    mask[1, :97] = 0
    return ids.cuda(), mask.cuda()


# Kernels at model sizes -------------------------------------------------------------------------------------------
def test_linear_and_norm_rows_at_model_sizes():
    from longspec_ops import invariant_linear, rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 74, 4096, device="cuda", generator=g).to(torch.bfloat16)
    xd = torch.randn(2, 74, 14336, device="cuda", generator=g).to(torch.bfloat16)
    # q/o_proj and k/v_proj (split-K), gate/up, the LM head, down_proj (split-K over K = 14336)
    for n, xin in ((4096, x), (1024, x), (14336, x), (128256, x), (4096, xd)):
        w = (torch.randn(n, xin.shape[-1], device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        batch, wide = invariant_linear(xin, w), invariant_linear(xin[1], w)
        for m in (0, 1, 37, 73):
            assert torch.equal(invariant_linear(xin[1, m:m + 1], w)[0], wide[m]), (n, m)
            assert torch.equal(wide[m], batch[1, m]), (n, m)
    w = torch.rand(4096, device="cuda", generator=g).to(torch.bfloat16)
    batch, wide = rms_norm(x, w, 1e-5), rms_norm(x[0], w, 1e-5)
    for m in (0, 37, 73):
        assert torch.equal(rms_norm(x[0, m:m + 1], w, 1e-5)[0], wide[m]) and torch.equal(wide[m], batch[0, m])


@pytest.mark.parametrize("heads", [(32, 8), (28, 4)])
def test_attention_tree_nodes_equal_decode_at_32k(heads):
    from longspec_ops import invariant_attn

    Hq, Hkv = heads
    anc, depths = _tree(2, (4, 16, 16, 16, 16), seed=0)
    M, D, N = anc.shape[1], 128, 32768 + 256
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, M, Hq, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(2, N, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(2, N, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
    seqlens = torch.tensor([32768 - 3, 30000], dtype=torch.int32, device="cuda")  # row 0 crosses a split boundary
    out, lse = invariant_attn(q, k, v, seqlens, anc, depths, D ** -0.5)
    for b in range(2):
        for m in range(M):
            o1, l1 = _decode_equivalent(q, k, v, seqlens, anc, depths, b, m, None, scale=D ** -0.5)
            assert torch.equal(o1[0, 0], out[b, m]) and torch.equal(l1[0, :, 0], lse[b, :, m]), (b, m)


# End to end -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("name", list(SHAPES))
def test_speculation_changes_no_token(name, context):
    target = _target(name)
    ids, mask = _prompts(context, target.config.vocab_size)
    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(target)
    drafters = {"prompt lookup": (PromptLookupDrafter(), (4, 4, 4)),
                "LongSpec tree": (LongSpecDrafter(draft), (4, 16, 16, 16, 16))}
    decoders = {"plain": SpeculativeDecoder(target, None, cuda_graphs=True, numerics=Numerics.INVARIANT)}
    for label, (drafter, shape) in drafters.items():
        decoders[label] = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=True,
                                             numerics=Numerics.INVARIANT)
    for temperature, seed in ((0.0, None), (1.0, 1234)):
        kw = dict(temperature=temperature, seed=seed, attention_mask=mask, eos_token_id=[])
        plain = decoders["plain"].generate(ids, NEW_TOKENS, **kw).sequences
        assert plain.shape[1] - ids.shape[1] == NEW_TOKENS
        for label in drafters:
            out = decoders[label].generate(ids, NEW_TOKENS, **kw)
            print(f"{name} {context} T={temperature} {label}: tau {out.stats.tau:.2f}")
            assert_same_tokens(out.sequences, plain)


@pytest.mark.parametrize("name", ["Llama-3-8B", "Qwen3-8B"])
def test_compiled_speculation_changes_no_token(name):
    """compile=True in INVARIANT mode compiles the target's layers (Inductor fuses RoPE, SiLU * up and the residual
    adds around the invariant custom ops): compiled speculation (prompt lookup, a LongSpec tree) equals compiled plain
    decoding in the same mode token for token, at T = 0 and seeded T = 1. (Compiled and eager decoding may part:
    Inductor's fused elementwise code rounds differently from eager's op-by-op code; the reference is plain decoding
    in the same mode and compile setting.)"""
    target = _target(name)
    ids, mask = _prompts(4096, target.config.vocab_size)
    torch.manual_seed(0)
    draft = LongSpecDraft.from_target(target)
    plain = SpeculativeDecoder(target, None, cuda_graphs=True, compile=True, numerics=Numerics.INVARIANT)
    drafters = {"prompt lookup": (PromptLookupDrafter(), (4, 4, 4)),
                "LongSpec tree": (LongSpecDrafter(draft), (4, 16, 16, 16, 16))}
    for temperature, seed in ((0.0, None), (1.0, 1234)):
        kw = dict(temperature=temperature, seed=seed, attention_mask=mask, eos_token_id=[])
        ref = plain.generate(ids, NEW_TOKENS, **kw).sequences
        for label, (drafter, shape) in drafters.items():
            dec = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=True, compile=True,
                                     numerics=Numerics.INVARIANT)
            out = dec.generate(ids, NEW_TOKENS, **kw)
            print(f"compiled {name} T={temperature} {label}: tau {out.stats.tau:.2f}")
            assert_same_tokens(out.sequences, ref)
