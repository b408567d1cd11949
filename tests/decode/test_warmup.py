"""SpeculativeDecoder.warmup on the CPU: after it, generate compiles nothing new (compile=True) for other prompt
lengths, max_new_tokens, batch sizes and temperatures it covered; outputs and a budget's statistics are what they
would have been without it; bad arguments are refused by name; a request beyond it warns and stays exact."""
from __future__ import annotations

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

from .test_adaptive import unit_costs
from .tiny_targets import assert_same_tokens, hf_greedy, ragged_batch, tiny_target

FAMILY = "llama-gqa-d64"


def _decoders(target, draft=None):
    draft = draft or LongSpecDraft.from_target(target)
    merged = TreeSpec.merged((2, 2), (1, 1))
    return {
        "plain": lambda **kw: SpeculativeDecoder(target, None, **kw),
        "pld": lambda **kw: SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=(1, 1, 1), **kw),
        "longspec-tree": lambda **kw: SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(2, 2), **kw),
        "adaptive": lambda **kw: SpeculativeDecoder(
            target, MergedDrafter(LongSpecDrafter(draft), PromptLookupDrafter()), tree_shape=merged,
            budget=AdaptiveBudget(budgets=(2, 4), depths=(2,)), **kw),
    }


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", ["longspec-tree", "adaptive"])  # plain and PLD too on the GPU (test_gpu_warmup)
def test_compiled_generate_after_warmup_compiles_nothing(name):
    """The guard that failed between a short first call and a longer second one (issue 36) was the KV cache's
    length: the cache grew, so every compiled function saw a new shape. A warmed decoder's cache is sized once
    for the largest request; its token buffer and round state are the slot's own, so no request within the
    warm-up changes a shape, and greedy output stays transformers' own."""
    target = tiny_target(FAMILY)
    dec = _decoders(target)[name](compile=True)
    if dec.budget is not None:
        dec.budget.costs = unit_costs(dec.budget.options)
    dec.warmup(batch_sizes=(1, 2), max_context=400, temperatures=(0.0, 0.8), progress=False)
    compiled = _unique_graphs()
    # the last request needs more than 256 cache rows: a cache sized by the first request would grow there
    for lens, new, temperature in (([40], 8, 0.0), ([40], 60, 0.0), ([90, 31], 40, 0.8), ([25, 70], 30, 0.0),
                                   ([300], 80, 0.0)):
        ids, mask = ragged_batch(lens, seed=len(lens) + new, period=9)
        out = dec.generate(ids, new, temperature=temperature, attention_mask=mask)
        assert _unique_graphs() == compiled, f"{name}: generate{lens, new, temperature} compiled after warmup"
        assert out.stats.captures == 0 and out.stats.time_capture == 0.0
        if temperature == 0.0:
            want, scores = hf_greedy(target, ids, mask, new)
            assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])


def test_warmup_changes_no_output_and_no_statistic():
    """The warm-up's synthetic rounds run with every row inactive and restore the budget's statistics, so a decoder
    warmed up between two calls (eager) gives the same tokens, option choices and statistics as one that was not:
    the first call's counts would otherwise decay (or move) under the warm-up's rounds."""
    target = tiny_target(FAMILY)
    draft = LongSpecDraft.from_target(target)  # one draft (random weights) for both decoders
    first, then = ragged_batch([37, 52], seed=4, period=9), ragged_batch([44, 29], seed=5, period=7)
    outs, stats = [], []
    for warm in (False, True):
        dec = _decoders(target, draft)["adaptive"]()
        dec.budget.costs = unit_costs(dec.budget.options)
        dec.generate(first[0], 24, attention_mask=first[1])
        if warm:
            report = dec.warmup(batch_sizes=(2,), max_context=120, progress=False)
            assert [s.batch for s in report.steps] == [2] and report.slot_bytes > 0 and "warmup" in str(report)
        outs.append(dec.generate(then[0], 24, attention_mask=then[1]))
        stats.append([t.clone() for t in dec.budget.stats_for(("greedy",), torch.device("cpu")).tensors()])
    assert_same_tokens(outs[1].sequences, outs[0].sequences)
    assert outs[1].stats.option_per_round == outs[0].stats.option_per_round
    for a, b in zip(*stats):
        assert torch.equal(a, b)


def test_warmed_slots_are_kept_and_a_longer_request_warns():
    """A warmed batch size keeps its slot (the same cache tensor) when calls of other batch sizes come between;
    a request longer than the warm-up reallocates it, with a warning, and stays exact."""
    target = tiny_target(FAMILY)
    dec = _decoders(target)["pld"]()
    dec.warmup(batch_sizes=(1,), max_context=80, progress=False)
    kv = dec._slots.slots[1].cache.kv
    for lens in ([30], [20, 25, 30], [30]):
        ids, mask = ragged_batch(lens, seed=1, period=7)
        dec.generate(ids, 16, attention_mask=mask)
    assert dec._slots.slots[1].cache.kv is kv and set(dec._slots.slots) == {1, 3}
    rows = dec._slots.slots[1].cache.max_len  # max_context rounded up to a multiple of 256 rows
    ids, mask = ragged_batch([70], seed=2, period=7)
    want, scores = hf_greedy(target, ids, mask, rows - 60)
    with pytest.warns(UserWarning, match="more than warmup"):
        out = dec.generate(ids, rows - 60, attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    assert dec._slots.slots[1].pinned and dec._slots.slots[1].cache.max_len > rows


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_sizes=(), max_context=64), "batch_sizes"),
    (dict(batch_sizes=(0,), max_context=64), "batch_sizes"),
    (dict(batch_sizes=(1,), max_context=None), "max_context"),
    (dict(batch_sizes=(1,), max_context=1.5), "max_context"),
    (dict(batch_sizes=(1,), max_context=64, temperatures=()), "temperatures"),
    (dict(batch_sizes=(1,), max_context=64, temperatures=(-1.0,)), "temperature"),
    (dict(batch_sizes=(1,), max_context=64, top_p=0.0), "top_p"),
    (dict(batch_sizes=(1,), max_context=10**6), "max_position_embeddings|positions"),
])
def test_warmup_refuses_bad_arguments(kwargs, match):
    dec = SpeculativeDecoder(tiny_target(FAMILY), PromptLookupDrafter(), tree_shape=(1, 1))
    with pytest.raises(ValueError, match=match):
        dec.warmup(progress=False, **kwargs)
    assert not dec._slots.slots  # nothing allocated
