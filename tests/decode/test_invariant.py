"""Numerics.INVARIANT on CPU (float32, the ops' reference kernels): the decoder's invariant path gives exactly plain
decoding's and transformers' tokens, the module swap leaves nothing behind, bad settings fail clearly. Bitwise
invariance of the GPU kernels in bf16 is tested in ``test_gpu_invariant.py``."""
from __future__ import annotations

import pytest
import torch

from longspec import LongSpecDraft, LongSpecDrafter, Numerics, PromptLookupDrafter, SpeculativeDecoder
from longspec.decode import KVUpdate
from longspec.decode.drafter import TreeSpec
from longspec.decode.tree import tree_mask_from_parents
from longspec.model.invariant import InvariantTarget, tree_ancestors

from .tiny_targets import assert_same_tokens, hf_greedy, ragged_batch, tiny_target

FAMILY = "llama-gqa-d64"


def test_greedy_equals_plain_and_transformers():
    target = tiny_target(FAMILY)
    ids, mask = ragged_batch([60, 33], seed=3, period=11)
    want, scores = hf_greedy(target, ids, mask, 24)
    plain = SpeculativeDecoder(target, None, numerics=Numerics.INVARIANT).generate(ids, 24, attention_mask=mask)
    assert_same_tokens(plain.sequences, want, scores, ids.shape[1])
    torch.manual_seed(0)
    for drafter, shape in ((PromptLookupDrafter(), (3, 3, 3)),
                           (LongSpecDrafter(LongSpecDraft.from_target(target)), (2, 4, 4))):
        dec = SpeculativeDecoder(target, drafter, tree_shape=shape, numerics=Numerics.INVARIANT)
        assert_same_tokens(dec.generate(ids, 24, attention_mask=mask).sequences, want, scores, ids.shape[1])


def test_seeded_sampling_equals_plain():
    target = tiny_target(FAMILY)
    ids, mask = ragged_batch([50, 41], seed=5, period=13)
    kw = dict(temperature=1.0, seed=1234, attention_mask=mask)
    plain = SpeculativeDecoder(target, None, numerics=Numerics.INVARIANT).generate(ids, 16, **kw).sequences
    spec = SpeculativeDecoder(target, PromptLookupDrafter(), tree_shape=(3, 3, 3), numerics=Numerics.INVARIANT)
    assert_same_tokens(spec.generate(ids, 16, **kw).sequences, plain)


def test_swap_is_scoped():
    """Inside ``active()`` every linear and RMSNorm of the layers, the final norm and the LM head run the invariant
    ops; outside, the model is untouched."""
    target = tiny_target("qwen3-gqa-d128")  # q/k norms too
    inv = InvariantTarget(target)
    layers = 2
    assert len(inv.modules) == layers * (7 + 4) + 2  # 7 linears, 4 norms per layer; final norm; LM head
    x = torch.randn(1, 3, target.config.hidden_size)
    head = target.get_output_embeddings()
    with inv.active():
        assert all("forward" in m.__dict__ for m in inv.modules)
        inside = head(x)
    assert not any("forward" in m.__dict__ for m in inv.modules)
    torch.testing.assert_close(inside, head(x))


def test_compile_compiles_the_invariant_target():
    """compile=True compiles the target's layers in INVARIANT mode as in FAST (the invariant linears, norms and
    attention stay opaque custom ops; tests/decode/test_gpu_invariant.py checks that compiled speculation equals
    compiled plain decoding bit for bit), and the drafter's propose and the tail. Nothing is run, so nothing
    compiles here."""
    target = tiny_target(FAMILY)
    drafter = PromptLookupDrafter()
    for numerics in Numerics:
        dec = SpeculativeDecoder(target, drafter, tree_shape=(3, 3), compile=True, numerics=numerics)
        assert dec._propose_fn is not drafter.propose
        with dec._compiled_layers():
            assert all(m._compiled_call_impl is not None for m in target.base_model.layers)
        assert all(m._compiled_call_impl is None for m in target.base_model.layers)


def test_tree_ancestors():
    spec = TreeSpec((2, 2, 1))
    parents = torch.tensor([[-1, 0, 0, 2, 1, 3]])
    anc, depths = tree_ancestors(tree_mask_from_parents(parents, spec))
    assert depths.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert anc[0, 5, :4].tolist() == [0, 2, 3, 5] and anc[0, 4, :3].tolist() == [0, 1, 4]


def test_bad_numerics():
    target = tiny_target(FAMILY)
    with pytest.raises(TypeError, match="numerics must be a Numerics"):
        SpeculativeDecoder(target, None, numerics="invariant")
    with pytest.raises(ValueError, match="needs kv_update=KVUpdate.COMMIT"):
        SpeculativeDecoder(target, LongSpecDrafter(LongSpecDraft.from_target(target)), numerics=Numerics.INVARIANT,
                           kv_update=KVUpdate.REFEED)
