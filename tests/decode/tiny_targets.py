"""Tiny random-initialised targets and batches for the decoding tests (CPU, float32; nothing is downloaded).

Each family covers one corner of the support matrix: GQA and MHA, head dims 64 and 128, RoPE scaling (llama3 and
linear), Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's sliding-window config (wider than the tests' sequences).
``initializer_range`` is raised above the library default so that greedy margins are not degenerate and the
random models fall into repetitive text, which gives the drafters something to accept.
"""
from __future__ import annotations

import functools

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 192
EOS = 2

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=512, initializer_range=0.2, eos_token_id=EOS, bos_token_id=1,
               tie_word_embeddings=False)

FAMILIES = {
    # GQA 4/2, head dim 64, llama3 RoPE scaling
    "llama-gqa-d64": (LlamaConfig, LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # MHA 2/2, head dim 128, q/k/v biases
    "qwen2-mha-d128": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=2, num_key_value_heads=2, head_dim=128)),
    # GQA 4/1, head dim 128, q/k norms
    "qwen3-gqa-d128": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128)),
    # MHA 2/2, head dim 64, linear RoPE scaling, sliding window wider than any test sequence
    "mistral-mha-d64": (MistralConfig, MistralForCausalLM, dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, sliding_window=4096,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
}


@functools.lru_cache(maxsize=None)
def tiny_target(family: str, seed: int = 0):
    """A float32 eval-mode model of ``family`` with weights from ``torch.manual_seed(seed)`` (cached: treat as
    read-only)."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**_COMMON, **extra)
    torch.manual_seed(seed)
    return model_cls(config).eval()


def ragged_batch(lens: list[int], seed: int, period: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids [B, S], attention_mask [B, S])`` with row lengths ``lens``.

    ``period > 0`` repeats a random block of that many tokens (repetitive text, for prompt lookup). Pad columns
    hold id 0; prompt tokens avoid the EOS id.
    """
    g = torch.Generator().manual_seed(seed)
    S = max(lens)
    ids = torch.zeros(len(lens), S, dtype=torch.int64)
    mask = torch.zeros(len(lens), S, dtype=torch.int64)
    for b, n in enumerate(lens):
        if period:
            block = torch.randint(3, VOCAB, (period,), generator=g)
            row = block.repeat(n // period + 1)[:n]
        else:
            row = torch.randint(3, VOCAB, (n,), generator=g)
        ids[b, S - n:], mask[b, S - n:] = row, 1
    return ids, mask


def hf_greedy(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, **kwargs):
    """transformers' own greedy decoding (sdpa attention, its DynamicCache), with the per-step scores."""
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         return_dict_in_generate=True, output_scores=True, **kwargs)
    return out.sequences, torch.stack(out.scores, dim=1)  # [B, S + G], [B, G, V]


def assert_same_tokens(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor | None = None, start: int = 0):
    """Exact token equality; on failure the message gives the first divergence and the reference's top-2 logit
    margin there (a tiny margin means a numerically degenerate case, to be replaced, never tolerated)."""
    if got.shape == want.shape and torch.equal(got, want):
        return
    msg = [f"shapes {tuple(got.shape)} vs {tuple(want.shape)}"]
    width = min(got.shape[1], want.shape[1])
    diff = (got[:, :width] != want[:, :width]).nonzero()
    if len(diff):
        b, t = diff[0].tolist()
        msg.append(f"first divergence at row {b}, column {t}: got {got[b, t].item()}, want {want[b, t].item()}")
        if scores is not None and t >= start:
            top2 = scores[b, t - start].topk(2).values
            msg.append(f"reference top-2 margin there: {float(top2[0] - top2[1]):.3g}")
    raise AssertionError("; ".join(msg))
