"""The engine on a GPU, CUDA graphs on: in float32 speculative output equals the engine's own plain decoding token
for token; in bf16 it may part only at numerical near-ties (checked against the float32 model's margin there)."""
from __future__ import annotations

import copy

import pytest
import torch

from longspec import (AdaptiveBudget, LongSpecDraft, LongSpecDrafter, MergedDrafter, PromptLookupDrafter,
                      SpeculativeDecoder, StreamingSelfDrafter, TreeSpec)
from longspec.decode.budget import CostModel
from longspec.testing import first_divergence

from ..conftest import requires_cuda
from .tiny_targets import FAMILIES, assert_same_tokens, ragged_batch, tiny_target

pytestmark = requires_cuda


def _cuda_target(family: str, dtype=torch.bfloat16):
    return copy.deepcopy(tiny_target(family)).to("cuda", dtype)  # the cached CPU model stays untouched


def _assert_ties_only(got, want, mask, target_fp32, bound: float = 0.1) -> None:
    """bf16 is lossless up to numerics: outputs may part only where the next token is a numerical near-tie. At the
    first divergence, the float32 model's top-2 logit margin on the agreed prefix must be below ``bound``."""
    d = first_divergence(got, want, target_fp32, mask)
    assert d is None or d.margin < bound, f"outputs differ at {d} where the float32 top-2 margin is not a tie"


def _drafters(target):
    return {
        "pld-tree": (PromptLookupDrafter(), (4, 4, 4)),
        "pld-chain": (PromptLookupDrafter(), (1, 1, 1, 1, 1)),
        "streaming": (StreamingSelfDrafter(sink=4, window=64), (2, 2, 2)),
        "longspec": (LongSpecDrafter(LongSpecDraft.from_target(target)), (4, 8, 8)),
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp32_speculative_equals_plain_with_graphs(family):
    """float32 on the GPU (IEEE dots in the Triton kernels): every path gives the same tokens, graphs on or off."""
    target = _cuda_target(family, torch.float32)
    ids, mask = ragged_batch([130, 63, 97], seed=3, period=17)
    ids, mask = ids.cuda(), mask.cuda()
    plain = SpeculativeDecoder(target, None, cuda_graphs=True).generate(ids, 40, attention_mask=mask).sequences
    eager = SpeculativeDecoder(target, None, cuda_graphs=False).generate(ids, 40, attention_mask=mask).sequences
    assert_same_tokens(plain, eager)
    for name, (drafter, shape) in _drafters(target).items():
        dec = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=True)
        out = dec.generate(ids, 40, attention_mask=mask)
        assert_same_tokens(out.sequences, plain)
        # graph capture is counted inside the rounds and apart: the first call captures the forwards, draft and
        # tail, on the batch size's slot; a later call of that batch size replays them and captures nothing
        again = dec.generate(ids, 40, attention_mask=mask).stats
        assert 0 < out.stats.time_capture < out.stats.time_decode and out.stats.captures >= 3
        assert again.time_capture == 0.0 and again.captures == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_speculative_equals_plain_up_to_ties(family):
    target = _cuda_target(family)
    ref32 = _cuda_target(family, torch.float32)
    ids, mask = ragged_batch([130, 63, 97], seed=3, period=17)
    ids, mask = ids.cuda(), mask.cuda()
    plain = SpeculativeDecoder(target, None, cuda_graphs=True).generate(ids, 40, attention_mask=mask).sequences
    for name, (drafter, shape) in _drafters(target).items():
        out = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=True).generate(
            ids, 40, attention_mask=mask)
        _assert_ties_only(out.sequences, plain, mask, ref32)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 1.0), (1.0, 0, 0.9)])
def test_fp32_seed_exact_sampling(temperature, top_k, top_p):
    target = _cuda_target("llama-gqa-d64", torch.float32)
    ids, mask = ragged_batch([90, 41], seed=5, period=13)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234, attention_mask=mask)
    plain = SpeculativeDecoder(target, None, cuda_graphs=True).generate(ids, 48, **kw).sequences
    spec = SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=(3, 3, 3), cuda_graphs=True).generate(
        ids, 48, **kw).sequences
    assert_same_tokens(spec, plain)


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 1234}], ids=["greedy", "seeded"])
def test_fp32_adaptive_merged_equals_plain(sampling, compile):
    """The adaptive merged drafter under CUDA graphs (prompt lookup's chain in ``prompt_lookup_chain``'s kernels,
    the budget's statistics in ``record_acceptance_``'s, every option a captured graph, the plain one's catch-up
    too), compiled or not: float32 greedy and seed-exact sampled tokens equal plain decoding's while the budget
    switches between options, plain rounds among them."""
    target = _cuda_target("llama-gqa-d64", torch.float32)
    ids, mask = ragged_batch([130, 63], seed=3, period=17)
    ids, mask = ids.cuda(), mask.cuda()
    plain = SpeculativeDecoder(target, None, cuda_graphs=True).generate(ids, 48, attention_mask=mask,
                                                                        **sampling).sequences
    budget = AdaptiveBudget(explore=2.0, window=4, budgets=(2, 4, 8), depths=(2,))
    drafter = MergedDrafter(LongSpecDrafter(LongSpecDraft.from_target(target)), PromptLookupDrafter())
    dec = SpeculativeDecoder(target, drafter, tree_shape=TreeSpec.merged((2, 4, 4), (1,) * 6), cuda_graphs=True,
                             budget=budget, compile=compile)
    # a round costs 10 + 0.3 us per node, a plain one 7 us, drafting is free: the choice moves between options
    budget.costs = CostModel({b: {o.nodes: (7.0, 0.0) if o.spec is None else (10.0 + 0.3 * o.nodes, 0.0)
                                  for o in budget.options} for b in (2,)},
                             {b: {o.draft_key: (0.0, 0.0) for o in budget.options} for b in (2,)})
    out = dec.generate(ids, 48, attention_mask=mask, **sampling)
    assert_same_tokens(out.sequences, plain)
    assert len(set(out.stats.option_per_round)) >= 2, out.stats.option_per_round
    plain_label = next(o.label for o in budget.options if o.spec is None)
    assert plain_label in out.stats.option_per_round, out.stats.option_per_round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rounds_equal_uncompiled(dtype):
    """compile=True under CUDA graphs (compiled layers, propose and tail, all captured): float32 gives the
    uncompiled engine's tokens exactly; bf16 may part only at near-ties."""
    target = _cuda_target("llama-gqa-d64", dtype)
    ref32 = _cuda_target("llama-gqa-d64", torch.float32)
    ids, mask = ragged_batch([130, 63, 97], seed=3, period=17)
    ids, mask = ids.cuda(), mask.cuda()
    plain = SpeculativeDecoder(target, None, cuda_graphs=True).generate(ids, 40, attention_mask=mask).sequences
    runs = {"plain": (None, (1,))} | _drafters(target)
    for name, (drafter, shape) in runs.items():
        dec = SpeculativeDecoder(target, drafter, tree_shape=shape, cuda_graphs=True, compile=True)
        for _ in range(2):  # the second call replays what the first compiled and captured
            out = dec.generate(ids, 40, attention_mask=mask)
            if dtype == torch.float32:
                assert_same_tokens(out.sequences, plain)
            else:
                _assert_ties_only(out.sequences, plain, mask, ref32)


def test_graphed_tail_with_a_generator_and_a_reduced_draft_vocab():
    """Unseeded sampling under CUDA graphs draws from the given torch.Generator (registered with the tail's graph):
    two runs from equal generator states give equal tokens; a reduced drafting vocabulary runs captured too."""
    target = _cuda_target("llama-gqa-d64", torch.float32)
    draft = LongSpecDraft.from_target(target).set_draft_vocab(torch.arange(0, 192, 2))
    ids, mask = ragged_batch([90, 41], seed=5, period=13)
    ids, mask = ids.cuda(), mask.cuda()
    outs = []
    for _ in range(2):
        gen = torch.Generator(device="cuda").manual_seed(11)
        dec = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(4, 4, 4), cuda_graphs=True, compile=True)
        outs.append(dec.generate(ids, 32, temperature=1.0, attention_mask=mask, generator=gen).sequences)
    assert_same_tokens(outs[0], outs[1])
    assert (outs[0] >= 0).all() and (outs[0] < 192).all()
