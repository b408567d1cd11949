"""compile=True: the target's layers, the drafter's propose and the round's tail under torch.compile change no token
(float32 on CPU, greedy against transformers and seed-exact sampling against plain decoding), and the attention
arguments are checked once per forward, not once per layer."""
from __future__ import annotations

import collections

import pytest
import torch

import longspec_ops._checks as checks
from longspec import (AdaptiveBudget, LongSpecDraft, LongSpecDrafter, MergedDrafter, PromptLookupDrafter,
                      SpeculativeDecoder)
from longspec.decode.budget import BudgetOption, CostModel
from longspec.decode.drafter import TreeSpec
from longspec.decode.tree import tree_mask_from_parents, tree_positions
from longspec.model.target import StaticKVCache, forward_extend, forward_tree, use_longspec_attention

from .tiny_targets import assert_same_tokens, hf_greedy, ragged_batch, tiny_target

FAMILY = "llama-gqa-d64"


def test_compiled_decoding_is_exact():
    """Plain, LongSpec-tree, prompt-lookup and merged (LongSpec + prompt lookup) decoding with compile=True
    reproduce transformers' greedy output (the LongSpec tree's draft with an extra cross block, the merged one's
    without); a second generate on the same decoder reuses what was compiled and stays exact."""
    target = tiny_target(FAMILY)
    ids, mask = ragged_batch([37, 22], seed=4, period=9)
    want, scores = hf_greedy(target, ids, mask, 24)
    draft = LongSpecDraft.from_target(target)
    grown = LongSpecDraft.from_target(target, extra_cross_blocks=1)
    for drafter, shape in ((None, (1,)), (LongSpecDrafter(grown), (2, 4, 4)), (PromptLookupDrafter(), (3, 3)),
                           (MergedDrafter(LongSpecDrafter(draft), PromptLookupDrafter()),
                            TreeSpec.merged((2, 2), (1, 1)))):
        dec = SpeculativeDecoder(target, drafter, tree_shape=shape, compile=True)
        for _ in range(2):
            out = dec.generate(ids, 24, attention_mask=mask)
            assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])


def test_compiled_seeded_sampling_equals_plain_sampling():
    """Seed-exact sampling holds compiled; the seed is data, so a new seed (and a new request length) compiles
    nothing new."""
    target = tiny_target(FAMILY)
    dec = SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=(3, 3), compile=True)
    for seed, lens, new in ((77, [41, 30], 20), (2**63 + 5, [35, 44], 17)):
        ids, mask = ragged_batch(lens, seed=6, period=11)
        kw = dict(temperature=0.9, top_k=40, top_p=0.95, seed=seed, attention_mask=mask)
        plain = SpeculativeDecoder(target, None).generate(ids, new, **kw).sequences
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert_same_tokens(dec.generate(ids, new, **kw).sequences, plain)
        if seed != 77:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "the second request recompiled"


def test_a_merged_drafters_parts_are_compiled(monkeypatch):
    """compile=True compiles a merged drafter's parts (each part's ``propose`` and ``observe``, once each; the merge
    itself runs as it is), with and without an adaptive budget, and the output stays transformers' greedy one. Under
    a budget that alternates plain rounds with the whole tree, every round calls the parts' compiled code and nothing
    else of theirs: the plain rounds' catch-up (``observe``) is the draft step of the plain option. torch.compile is
    replaced by a recorder that returns the function, counting its calls, so this checks what is compiled and run,
    not the compiler (the real compile: test_compiled_decoding_is_exact)."""
    compiled, calls = [], collections.Counter()

    def record(fn, **kw):
        compiled.append(fn)
        name = (type(getattr(fn, "__self__", None)).__name__, fn.__name__)
        return lambda *a, **k: (calls.update([name]), fn(*a, **k))[1]

    monkeypatch.setattr(torch, "compile", record)
    target = tiny_target(FAMILY)
    ids, mask = ragged_batch([37, 22], seed=4, period=9)
    want, scores = hf_greedy(target, ids, mask, 24)
    draft = LongSpecDraft.from_target(target)
    spec = TreeSpec.merged((2, 2), (1, 1))
    alternating = AdaptiveBudget(options=[BudgetOption(None, 1), BudgetOption(spec, spec.num_nodes)])
    for budget in (None, AdaptiveBudget(budgets=(2,), depths=(1,)), alternating):
        compiled.clear()
        calls.clear()
        parts = (LongSpecDrafter(draft), PromptLookupDrafter())
        dec = SpeculativeDecoder(target, MergedDrafter(*parts), tree_shape=spec, compile=True, budget=budget)
        mine = sorted((type(fn.__self__).__name__, fn.__name__) for fn in compiled
                      if getattr(fn, "__self__", None) in parts)
        assert mine == [("LongSpecDrafter", "observe"), ("LongSpecDrafter", "propose"),
                        ("PromptLookupDrafter", "observe"), ("PromptLookupDrafter", "propose")]
        if budget is alternating:
            budget.costs = CostModel({b: {1: (1.0, 0.0), spec.num_nodes: (1.0, 0.0)} for b in (1, 2)},
                                     {b: {o.draft_key: (0.0, 0.0) for o in budget.options} for b in (1, 2)})
            rounds = iter(range(1000))
            budget.choose = lambda *args: next(rounds) % 2  # plain, whole, plain, ...
        with monkeypatch.context() as m:  # the parts' own methods run only inside their compiled wrappers
            for part in parts:
                for method in ("propose", "observe"):
                    own = getattr(part, method)
                    m.setattr(part, method, lambda *a, own=own, **k: pytest.fail(f"{own} ran uncompiled"))
            out = dec.generate(ids, 24, attention_mask=mask)
        assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
        if budget is alternating:
            # the host enqueues one round past the last (dropped from the stats): it may be a plain one
            plain = out.stats.option_per_round.count(budget.options[0].label)
            assert plain >= 3 and plain <= calls[("LongSpecDrafter", "observe")] <= plain + 1, (plain, calls)


def test_compiled_layers_are_switched_off_outside_generate():
    """The compiled calls exist only inside a generate: the model the user holds runs eagerly afterwards."""
    target = tiny_target(FAMILY)
    dec = SpeculativeDecoder(target, None, compile=True)
    ids, mask = ragged_batch([12], seed=1)
    dec.generate(ids, 3, attention_mask=mask)
    assert all(m._compiled_call_impl is None for m in target.base_model.layers)
    assert not any(hasattr(layer.self_attn, "longspec_kv") for layer in target.base_model.layers)


@pytest.mark.parametrize("phase", ["extend", "tree"])
def test_attention_arguments_are_checked_once_per_forward(monkeypatch, phase):
    """The first layer's call runs the op's argument checks, the others its unchecked twin (same metadata)."""
    target = tiny_target(FAMILY)
    name = "check_prefix" if phase == "extend" else "check_hybrid"
    calls = []
    original = getattr(checks, name)
    monkeypatch.setattr(checks, name, lambda *a: (calls.append(1), original(*a))[1])
    cache = StaticKVCache.from_config(target.config, 2, 64, torch.float32, "cpu")
    spec = TreeSpec((2, 2))
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 2)
    with torch.inference_mode(), use_longspec_attention(target):
        forward_extend(target, cache, torch.randint(0, 100, (2, 9)))
        cache.seqlens.fill_(9)
        calls.clear()
        for _ in range(2):  # two forwards: one check each
            if phase == "extend":
                forward_extend(target, cache, torch.randint(0, 100, (2, 1)))
            else:
                forward_tree(target, cache, torch.randint(0, 100, (2, 5)), tree_positions(cache.seqlens, spec),
                             tree_mask_from_parents(parents, spec))
    assert target.config.num_hidden_layers > 1 and len(calls) == 2
