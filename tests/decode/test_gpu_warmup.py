"""warmup() on a GPU (issues 34 and 36): after it, no generate captures a CUDA graph or compiles, for plain, prompt
lookup, the LongSpec tree and the adaptive merged drafter, across prompt lengths, max_new_tokens, batch sizes and
temperatures; float32 outputs stay equal to plain decoding; and many float32 decoders built and dropped in one
process all capture cleanly (the cudaErrorStreamCaptureInvalidated once seen there)."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from longspec import (
    AdaptiveBudget,
    LongSpecDraft,
    LongSpecDrafter,
    MergedDrafter,
    PromptLookupDrafter,
    SpeculativeDecoder,
    TreeSpec,
)

from ..conftest import requires_cuda
from .test_adaptive import unit_costs
from .tiny_targets import assert_same_tokens, ragged_batch, tiny_target

pytestmark = requires_cuda
FAMILY = "llama-gqa-d64"


def _cuda_target(dtype=torch.float32):
    return copy.deepcopy(tiny_target(FAMILY)).to("cuda", dtype)


def _decoder(name, target, **kw):
    draft = LongSpecDraft.from_target(target)
    if name == "plain":
        return SpeculativeDecoder(target, None, **kw)
    if name == "pld":
        return SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=(1,) * 6, **kw)
    if name == "longspec-tree":
        return SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(4, 8, 8), **kw)
    dec = SpeculativeDecoder(target, MergedDrafter(LongSpecDrafter(draft), PromptLookupDrafter()),
                             tree_shape=TreeSpec.merged((4, 8, 8), (1, 1, 1, 1)),
                             budget=AdaptiveBudget(budgets=(4, 16), depths=(2, 4)), **kw)
    dec.budget.costs = unit_costs(dec.budget.options, batches=(1, 3))
    return dec


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "graphs+compile"])
@pytest.mark.parametrize("name", ["plain", "pld", "longspec-tree", "adaptive"])
def test_generate_after_warmup_captures_and_compiles_nothing(name, compile):
    target = _cuda_target()
    dec = _decoder(name, target, cuda_graphs=True, compile=compile)
    report = dec.warmup(batch_sizes=(1, 3), max_context=400, temperatures=(0.0, 1.0), progress=False)
    assert report.steps and sum(s.captures for s in report.steps) > 0 and report.graph_bytes is not None
    plain = SpeculativeDecoder(target, None)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for lens, new, temperature in (([60], 16, 0.0), ([60], 200, 0.0), ([150, 90, 33], 100, 1.0), ([41], 70, 1.0),
                                   ([120, 20, 77], 64, 0.0)):
        ids, mask = ragged_batch(lens, seed=new, period=13)
        ids, mask = ids.cuda(), mask.cuda()
        kw = dict(temperature=temperature, attention_mask=mask)
        out = dec.generate(ids, new, **kw)
        assert out.stats.captures == 0 and out.stats.time_capture == 0.0, f"{name}: {lens, new} captured"
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled, f"{name}: {lens, new} compiled"
        if temperature == 0.0:
            assert_same_tokens(out.sequences, plain.generate(ids, new, **kw).sequences)


def test_fifty_float32_decoders_built_and_dropped_capture_cleanly():
    """The sequence that once invalidated a float32 draft-chain capture: decoders built, used and dropped one
    after another in one process, their graphs' destructors running between captures."""
    target = _cuda_target()
    draft = LongSpecDraft.from_target(target)
    ids, mask = ragged_batch([90, 45], seed=5, period=11)
    ids, mask = ids.cuda(), mask.cuda()
    want = SpeculativeDecoder(target, None).generate(ids, 24, attention_mask=mask).sequences
    for i in range(50):
        drafter = LongSpecDrafter(draft) if i % 2 == 0 else PromptLookupDrafter()
        shape = (1,) * (3 + i % 4) if i % 3 else (2, 4, 4)
        dec = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=True)
        out = dec.generate(ids, 24, attention_mask=mask)
        assert_same_tokens(out.sequences, want)
        assert out.stats.captures >= 3
        del dec, drafter, out
        if i % 10 == 9:
            gc.collect()
