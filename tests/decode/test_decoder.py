"""SpeculativeDecoder end to end on tiny random models (CPU, float32): exact equality, seeds, stops, errors."""
from __future__ import annotations

import functools

import pytest
import torch

from longspec import PromptLookupDrafter, SpeculativeDecoder, StreamingSelfDrafter
from longspec.decode.decoder import KVUpdate
from longspec.decode.tail import stop_lengths
from longspec.decode.drafter import DraftTree

from .tiny_targets import EOS, FAMILIES, assert_same_tokens, hf_greedy, ragged_batch, tiny_target

NEW = 24
BATCHES = {
    1: ([70], 11),  # one row straddling 64
    3: ([130, 63, 97], 12),  # ragged rows straddling 64 and 128
}

# case -> (batch, drafter factory, tree shape)
CASES = {
    "plain": (3, lambda: None, (1,)),
    "pld-chain": (1, lambda: PromptLookupDrafter(), (1, 1, 1, 1)),
    "pld-tree": (3, lambda: PromptLookupDrafter(max_ngram=4), (4, 8, 8)),
    "streaming-chain": (3, lambda: StreamingSelfDrafter(sink=4, window=256), (1, 1, 1)),
    # the view (4 sink + 16 recent rows) is far shorter than the prompt: drafts are worse, output identical
    "streaming-tree-window": (1, lambda: StreamingSelfDrafter(sink=4, window=16), (2, 3, 3)),
}


@functools.lru_cache(maxsize=None)
def reference(family: str, batch: int):
    lens, seed = BATCHES[batch]
    ids, mask = ragged_batch(lens, seed=seed, period=13)
    want, scores = hf_greedy(tiny_target(family), ids, mask, NEW)
    return ids, mask, want, scores


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family, case):
    """Token-for-token equality with ``model.generate(do_sample=False)``, EOS stops and padding included."""
    batch, make_drafter, shape = CASES[case]
    ids, mask, want, scores = reference(family, batch)
    drafter = make_drafter()
    out = SpeculativeDecoder(tiny_target(family), drafter, tree_shape=shape).generate(
        ids, max_new_tokens=NEW, attention_mask=mask)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    generated = (out.sequences[:, ids.shape[1]:] != EOS).sum(1) + (out.sequences[:, ids.shape[1]:] == EOS).any(1).long()
    for b in range(batch):  # every emitted token is accounted for: 1 from the prefill + one per accept length
        assert sum(out.accept_lengths[b]) + 1 == int(generated[b])
    if drafter is not None and case != "streaming-tree-window":
        assert max(max(row, default=0) for row in out.accept_lengths) >= 2, "no draft token was ever accepted"
    assert out.stats.time_capture == 0.0  # no CUDA graphs here
    # the round the host ran ahead on finished rows is not counted: the longest row took part in every round
    assert out.stats.rounds == max(len(row) for row in out.accept_lengths)
    if case == "streaming-chain":
        assert out.stats.tau > 2.5  # the view covers the whole context: the draft is the target itself


SAMPLED = [(0.7, 20, 1.0), (1.0, 0, 0.9)]


@functools.lru_cache(maxsize=None)
def plain_sampled(family: str, temperature: float, top_k: int, top_p: float, seed: int):
    ids, mask = ragged_batch([40, 29], seed=3, period=7)
    out = SpeculativeDecoder(tiny_target(family), None).generate(
        ids, max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, attention_mask=mask)
    return ids, mask, out.sequences


@pytest.mark.parametrize("sampling", SAMPLED, ids=lambda s: f"T{s[0]}-k{s[1]}-p{s[2]}")
@pytest.mark.parametrize("drafter_case", ["pld-tree", "streaming-chain"])
@pytest.mark.parametrize("family", ["llama-gqa-d64", "qwen3-gqa-d128"])
def test_seeded_speculative_equals_plain_sampling(family, drafter_case, sampling):
    """With a seed, speculative sampling emits exactly the plain sampler's tokens (counter-based Gumbel noise)."""
    temperature, top_k, top_p = sampling
    ids, mask, want = plain_sampled(family, temperature, top_k, top_p, seed=1234)
    _, make_drafter, shape = CASES[drafter_case]
    out = SpeculativeDecoder(tiny_target(family), make_drafter(), tree_shape=shape).generate(
        ids, max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=1234, attention_mask=mask)
    assert_same_tokens(out.sequences, want)
    greedy = SpeculativeDecoder(tiny_target(family), None).generate(ids, max_new_tokens=NEW, attention_mask=mask)
    assert not torch.equal(greedy.sequences, want), "the sampled run should differ from greedy decoding"


def test_deterministic_when_seeded():
    """Same seed, same tokens (speculative and plain); another seed, other tokens; a seeded Generator also
    reproduces, and rows do not depend on the batch composition in seed-exact mode."""
    model = tiny_target("llama-gqa-d64")
    ids, mask = ragged_batch([40, 29], seed=3, period=7)
    dec = SpeculativeDecoder(model, PromptLookupDrafter(), tree_shape=(2, 2, 2))
    kw = dict(max_new_tokens=NEW, temperature=1.0, attention_mask=mask)
    a, b = dec.generate(ids, seed=7, **kw), dec.generate(ids, seed=7, **kw)
    assert torch.equal(a.sequences, b.sequences) and a.accept_lengths == b.accept_lengths
    assert not torch.equal(a.sequences, dec.generate(ids, seed=8, **kw).sequences)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(dec.generate(ids, generator=g1, **kw).sequences, dec.generate(ids, generator=g2, **kw).sequences)
    # row 0 alone (no padding) reproduces row 0 of the batch: noise keyed by (seed, row, position), not by batch
    alone = dec.generate(ids[:1], seed=7, max_new_tokens=NEW, temperature=1.0).sequences
    assert torch.equal(alone, a.sequences[:1, : alone.shape[1]])


def test_eos_per_row_and_exact_budget():
    """A stop id hit by one row ends that row (later tokens of the round dropped, right-padded) while the others
    continue; rows without EOS get exactly max_new_tokens; equal to transformers with the same eos."""
    model = tiny_target("qwen2-mha-d128")
    ids, mask = ragged_batch([30, 21, 25], seed=4, period=5)
    dec = SpeculativeDecoder(model, PromptLookupDrafter(), tree_shape=(3, 3, 3))
    free = dec.generate(ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=[])
    assert free.sequences.shape[1] == ids.shape[1] + NEW  # no stop id: exactly the budget, every row
    stop = int(free.sequences[0, ids.shape[1] + 6])  # a token row 0 emits mid-way
    out = dec.generate(ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=stop)
    want, scores = hf_greedy(model, ids, mask, NEW, eos_token_id=stop, pad_token_id=stop)
    assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
    for budget in (1, 2, 5):
        short = dec.generate(ids, max_new_tokens=budget, attention_mask=mask, eos_token_id=[])
        assert torch.equal(short.sequences, free.sequences[:, : ids.shape[1] + budget])


def test_stop_lengths_table():
    emitted = torch.tensor([[5, 6, 7, 8], [5, 9, 6, 9], [9, 1, 1, 1], [5, 6, 7, 8]])
    counts = torch.tensor([4, 4, 3, 2])
    remaining = torch.tensor([2, 10, 10, 10])
    active = torch.tensor([True, True, True, False])
    kept, finished = stop_lengths(emitted, counts, torch.tensor([9]), remaining, active)
    assert kept.tolist() == [2, 2, 1, 0]  # budget; first EOS; EOS first; inactive
    assert finished.tolist() == [True, True, True, False]
    kept, finished = stop_lengths(emitted, counts, torch.tensor([], dtype=torch.int64), remaining, active)
    assert kept.tolist() == [2, 4, 3, 0] and finished.tolist() == [True, False, False, False]


class _WrongShapeDrafter:
    def prefill(self, state, tree):
        pass

    def propose(self, state, tree):
        B = state.root.shape[0]
        return DraftTree(state.root[:, None].expand(B, 2).clone(), torch.tensor([[-1, 0]] * B))


class _VocabDrafter(_WrongShapeDrafter):
    vocab_size = 7


def test_bad_arguments():
    model = tiny_target("llama-gqa-d64")
    ids, mask = ragged_batch([9, 6], seed=0)
    dec = SpeculativeDecoder(model, None)
    cases = [
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(temperature=1.0, top_k=-2), "top_k must be an int >= 0"),
        (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, seed=-1), "seed must be None or an int"),
        (dict(attention_mask=mask[:, 1:]), "attention_mask must have input_ids' shape"),
        (dict(attention_mask=mask.flip(1)), "attention_mask must mark left padding"),
        (dict(max_new_tokens=600), "exceeds the model's max_position_embeddings"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            dec.generate(ids, **kwargs)
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        dec.generate(ids.float())
    with pytest.raises(ValueError, match="tree_shape must be a non-empty sequence"):
        SpeculativeDecoder(model, PromptLookupDrafter(), tree_shape=(2, 0))
    with pytest.raises(TypeError, match="Drafter protocol"):
        SpeculativeDecoder(model, object())
    with pytest.raises(ValueError, match=r"drafter's vocabulary \(7\) differs from the target's \(192\)"):
        SpeculativeDecoder(model, _VocabDrafter())
    with pytest.raises(ValueError, match=r"must propose tokens and parents of shape \[B, 4\]"):
        SpeculativeDecoder(model, _WrongShapeDrafter(), tree_shape=(1, 1, 1)).generate(ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="more than max_cache_len=32"):
        SpeculativeDecoder(model, None, max_cache_len=32).generate(ids, max_new_tokens=30)
    with pytest.raises(ValueError, match="KVUpdate.REFEED keeps only the target's last layer"):
        SpeculativeDecoder(model, StreamingSelfDrafter(), kv_update=KVUpdate.REFEED)
    with pytest.raises(TypeError, match="kv_update must be a KVUpdate"):
        SpeculativeDecoder(model, PromptLookupDrafter(), kv_update="refeed")
    with pytest.raises(ValueError, match="min_ngram must be an int >= 1"):
        PromptLookupDrafter(min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram must be an int >= min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        StreamingSelfDrafter(window=-1)


def test_chunked_prefill_and_cache_reuse():
    """Prefill in chunks smaller than the prompt, and a second call on the reused cache, change nothing."""
    ids, mask, want, scores = reference("mistral-mha-d64", 3)
    dec = SpeculativeDecoder(tiny_target("mistral-mha-d64"), PromptLookupDrafter(), tree_shape=(2, 2),
                             prefill_chunk_size=48)
    for _ in range(2):
        out = dec.generate(ids, max_new_tokens=NEW, attention_mask=mask)
        assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (4, 8, 8)])
@pytest.mark.parametrize("family", ["llama-gqa-d64", "qwen3-gqa-d128"])
def test_refeed_strategy_is_exact(family, shape):
    """KVUpdate.REFEED gives the same tokens as COMMIT and transformers; its last layer holds the same rows."""
    ids, mask, want, scores = reference(family, 3)
    caches = {}
    for kv_update in KVUpdate:
        dec = SpeculativeDecoder(tiny_target(family), PromptLookupDrafter(), tree_shape=shape, kv_update=kv_update)
        out = dec.generate(ids, max_new_tokens=NEW, attention_mask=mask)
        assert_same_tokens(out.sequences, want, scores, start=ids.shape[1])
        caches[kv_update] = dec._cache
    commit, refeed = caches[KVUpdate.COMMIT], caches[KVUpdate.REFEED]
    assert torch.equal(commit.seqlens, refeed.seqlens)
    for b, n in enumerate(commit.seqlens.tolist()):
        torch.testing.assert_close(refeed.kv[-1, :, b, :n], commit.kv[-1, :, b, :n], rtol=1e-5, atol=1e-5)
        held = n - len(shape) - 1  # every layer holds at least the rows before the last accepted path
        torch.testing.assert_close(refeed.kv[:, :, b, :held], commit.kv[:, :, b, :held], rtol=1e-5, atol=1e-5)
    ids2, mask2, sampled = plain_sampled(family, 1.0, 0, 0.9, seed=1234)
    out = SpeculativeDecoder(tiny_target(family), PromptLookupDrafter(), tree_shape=shape,
                             kv_update=KVUpdate.REFEED).generate(ids2, max_new_tokens=NEW, temperature=1.0, top_p=0.9,
                                                                 seed=1234, attention_mask=mask2)
    assert_same_tokens(out.sequences, sampled)


@pytest.mark.parametrize("sampling", [(1.0, 5, 1.0), (1.0, 0, 0.75), (0.6, 3, 0.5)],
                         ids=["top_k-all-tied", "top_p-all-equal", "both"])
@pytest.mark.parametrize("drafter_case", ["pld-tree", "streaming-chain"])
def test_seeded_speculation_at_sampling_boundaries(drafter_case, sampling):
    """A target whose logits are all equal (its final norm zeroed): every token ties with the k-th and the nucleus
    boundary falls among ties. Speculative sampling still emits exactly the plain sampler's tokens."""
    import copy

    temperature, top_k, top_p = sampling
    target = copy.deepcopy(tiny_target("llama-gqa-d64"))
    with torch.no_grad():
        target.model.norm.weight.zero_()
    ids, mask = ragged_batch([40, 29], seed=3, period=7)
    kw = dict(max_new_tokens=NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=99, attention_mask=mask)
    want = SpeculativeDecoder(target, None).generate(ids, **kw).sequences
    _, make_drafter, shape = CASES[drafter_case]
    got = SpeculativeDecoder(target, make_drafter(), tree_shape=shape).generate(ids, **kw).sequences
    assert_same_tokens(got, want)
    assert len(set(want[0, ids.shape[1]:].tolist())) > 3  # the draws spread over the tied tokens
