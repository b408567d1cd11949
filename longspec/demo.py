"""``longspec demo``: one long prompt decoded plainly and speculatively, with tau, tokens/s and an equality check.

No model weights ship yet (the project's trained target/draft pair is future work), so the demo builds a small
random-initialised Llama target from a config, seeded. Its weights are scaled up (``initializer_range`` 0.2) so
that greedy decoding falls into repetitive text, which gives prompt lookup something to accept. The LongSpec draft
is freshly initialised too: its row shows the draft's cost and that its output is exact, not its acceptance.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class DemoResult:
    method: str
    tau: float
    tokens_per_s: float
    identical: bool


def demo_target(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def demo_prompt(length: int, device: str) -> torch.Tensor:
    """A long prompt with repeated blocks, as source code repeats identifiers and idioms."""
    g = torch.Generator().manual_seed(1)
    blocks = [torch.randint(3, 512, (n,), generator=g) for n in (37, 53, 61)]
    pieces, i = [], 0
    while sum(len(p) for p in pieces) < length:
        pieces.append(blocks[i % 3] if i % 4 else torch.randint(3, 512, (11,), generator=g))
        i += 1
    return torch.cat(pieces)[:length][None].to(device)


def run_demo(context: int = 2048, new_tokens: int = 96, device: str | None = None) -> list[DemoResult]:
    from longspec import LongSpecDraft, LongSpecDrafter, PromptLookupDrafter, SpeculativeDecoder

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = demo_target(device, dtype)
    ids = demo_prompt(context, device)
    cuda = device.startswith("cuda")
    methods = {
        "plain decoding (same kernels)": (None, (1,)),
        "prompt lookup, chain of 6": (PromptLookupDrafter(), (1,) * 6),
        "LongSpec draft (untrained), tree 4-16-16-16-16": (LongSpecDrafter(LongSpecDraft.from_target(target)),
                                                           (4, 16, 16, 16, 16)),
    }
    results, reference = [], None
    for name, (drafter, shape) in methods.items():
        dec = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=cuda)
        dec.generate(ids, 8)  # warm-up (kernel compilation, graph capture)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = dec.generate(ids, new_tokens)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        reference = out.sequences if reference is None else reference
        results.append(DemoResult(name, out.stats.tau, out.stats.generated_tokens / seconds,
                                  bool(torch.equal(out.sequences, reference))))
    return results
