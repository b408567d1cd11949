"""``longspec demo``: the shipped trained pair decodes a held-out long code prompt plainly, with prompt lookup and
with the LongSpec draft; it prints tau, tokens/s and whether each output is identical to plain decoding.

The pair (:mod:`longspec.pretrained`) was trained on Python source split by package; the prompt is built from a
held-out package of this machine's standard library, so the model never saw it in training. float32 by default,
where speculative output equals plain decoding token for token (the exit status checks it). On a CPU the
69-node verify is compute-bound (about ten decode steps' cost), so the tree loses to plain decoding there even at
tau 3-4; the H200 figures are in ``benchmarks/results/h200/e2e.md``. ``dtype=bfloat16``
is faster on a GPU, but there the verify and decode kernels round differently, so outputs may part where the
target's top two logits (nearly) tie.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

TREE = (4, 16, 16, 16, 16)


@dataclass
class DemoResult:
    method: str
    tau: float
    tokens_per_s: float
    identical: bool
    first_difference: int | None  # generated-token index where the output leaves plain decoding's


@dataclass
class DemoReport:
    package: str  # the held-out package the prompt comes from
    context: int
    new_tokens: int
    device: str
    dtype: str
    results: list[DemoResult]
    continuation: str  # plain decoding's generated text


def run_demo(context: int = 4096, new_tokens: int = 128, device: str | None = None,
             dtype: torch.dtype = torch.float32, seed: int = 0) -> DemoReport:
    from longspec import LongSpecDrafter, PromptLookupDrafter, SpeculativeDecoder
    from longspec.pretrained import heldout_stdlib_prompt, load_code_pair
    from longspec.testing import first_difference

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    pair = load_code_pair(device, dtype)
    ids, package = heldout_stdlib_prompt(pair.tokenizer, context, seed=seed)
    ids = ids.to(device)
    cuda = device.startswith("cuda")
    methods = {
        "plain decoding (same kernels)": (None, (1,)),
        "prompt lookup, chain of 6": (PromptLookupDrafter(), (1,) * 6),
        "LongSpec draft, tree 4-16-16-16-16": (LongSpecDrafter(pair.draft), TREE),
        "LongSpec draft, chain of 5": (LongSpecDrafter(pair.draft), (1,) * 5),
    }
    results, reference = [], None
    for name, (drafter, shape) in methods.items():
        dec = SpeculativeDecoder(pair.target, drafter, tree_shape=shape, cuda_graphs=cuda)
        if cuda:  # warm-up: kernel compilation and graph capture (on a CPU there is neither)
            dec.generate(ids, 8, eos_token_id=[])
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = dec.generate(ids, new_tokens, eos_token_id=[])
        if cuda:
            torch.cuda.synchronize()
        decode_s = time.perf_counter() - t0 - out.stats.time_prefill
        generated = out.sequences[:, ids.shape[1]:]
        reference = generated if reference is None else reference
        diff = first_difference(generated, reference)
        results.append(DemoResult(name, out.stats.tau, out.stats.generated_tokens / decode_s, diff is None, diff))
    text = pair.tokenizer.decode(reference[0])
    return DemoReport(package, context, new_tokens, device, str(dtype).removeprefix("torch."), results, text)
