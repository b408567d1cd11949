"""Extra cross-attention blocks (``extra_cross_blocks``, :func:`~longspec.model.draft_grow.add_cross_blocks`): the
block stack against the dense float64 reference, in training's forward and in tree drafting; growing a trained draft
keeps its function; the grown draft saves, loads and drafts exactly."""
from __future__ import annotations

import pytest
import torch

from longspec import LongSpecDraft, LongSpecDrafter
from longspec.decode.drafter import TreeSpec
from longspec.model.draft_config import LongSpecDraftConfig
from longspec.model.draft_grow import add_cross_blocks

from ..decode.test_longspec_drafter import check_contract, commit_random_path, make_state, record_levels
from .draft_reference import DenseDraft, beam_select, randomize, tiny_target
from .test_draft_grow import _inputs


@pytest.mark.parametrize("delta", [1, 3])
def test_forward_with_extra_blocks_matches_dense_float64(delta):
    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target, window=5, extra_cross_blocks=2)
    assert [n for n, _ in draft.extra_blocks[0].named_children()] == ["cross_norm", "cross_attn", "mlp_norm", "mlp"]
    assert len(draft.state_dict()) == 20 + 2 * 8  # each block: 2 norms, q (w, b), o, gate, up, down
    randomize(draft)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 160, (1, 14), generator=g)
    tk, tv = torch.randn(1, 16, 2, 16, generator=g), torch.randn(1, 16, 2, 16, generator=g)
    with torch.no_grad():
        got = draft.logits(draft(ids, tk, tv, delta=delta))[0].double()
        one = LongSpecDraft.from_target(target, window=5)
        randomize(one)
        without = one.logits(one(ids, tk, tv, delta=delta))[0].double()
    want = DenseDraft(draft, target).sequence_logits(ids[0].tolist(), tk[0], tv[0], delta=delta)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert (got - without).abs().max() > 0.1  # the extra blocks do change the output


def test_tree_drafting_with_extra_blocks_matches_dense_recomputation():
    target = tiny_target("qwen2", (4, 2))
    draft = LongSpecDraft.from_target(target, window=4, extra_cross_blocks=1)
    randomize(draft)
    spec = TreeSpec((3, 4, 2))
    g = torch.Generator().manual_seed(7)
    lens = (9, 5)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in lens]
    state = make_state(target, prompts, max(lens) + 3 * (spec.depth + 1) + 4, seed=11)
    drafter = LongSpecDrafter(draft)
    drafter.prefill(state, spec)
    levels = record_levels(drafter)
    dense = DenseDraft(draft, target)
    L = target.config.num_hidden_layers
    for _ in range(3):
        levels.clear()
        tree = drafter.propose(state, spec)
        check_contract(tree, spec, state.root)
        got = torch.cat(levels, dim=1).double()
        for b in range(len(lens)):
            r = int(state.seqlens[b])
            want = dense.tree_round(state.tokens[b, :r].tolist(), state.root[b], tree, b, spec.depths,
                                    state.cache.key(L - 1)[b], state.cache.value(L - 1)[b])
            torch.testing.assert_close(got[b], want[: spec.offsets[spec.depth]], atol=2e-4, rtol=1e-4)
            tokens, parents = beam_select(want, tree, b, spec.shape, spec.offsets)
            assert tree.tokens[b, 1:].tolist() == tokens and tree.parents[b, 1:].tolist() == parents
        commit_random_path(state, tree, g)


def test_grown_draft_computes_the_same_function_then_learns():
    target = tiny_target("llama", (4, 2)).double()
    draft = LongSpecDraft.from_target(target, window=5)
    randomize(draft)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    grown = add_cross_blocks(draft, 1, seed=1)
    again = add_cross_blocks(grown, 2, seed=2)  # growing a grown draft appends after its blocks
    assert grown.config.extra_cross_blocks == 1 and again.config.extra_cross_blocks == 3
    assert draft.config.extra_cross_blocks == 0 and len(draft.extra_blocks) == 0
    assert all(torch.equal(before[k], v) for k, v in draft.state_dict().items())  # the original is untouched
    assert grown.dtype == torch.float64 and not grown.training and grown.target is target
    blk = grown.extra_blocks[0]
    assert not blk.cross_attn.o_proj.weight.any() and not blk.mlp.down_proj.weight.any()
    assert torch.equal(blk.cross_norm.weight, torch.ones(64, dtype=torch.float64))
    assert 0.5 * grown.config.initializer_range < blk.mlp.up_proj.weight.std() < 2 * grown.config.initializer_range
    assert torch.equal(again.extra_blocks[0].mlp.up_proj.weight, blk.mlp.up_proj.weight)
    ids, tk, tv = _inputs()
    with torch.no_grad():
        want = draft.logits(draft(ids, tk, tv, delta=2))
        for model in (grown, again):
            torch.testing.assert_close(model.logits(model(ids, tk, tv, delta=2)), want, atol=1e-12, rtol=0)
    grown.train()
    opt = torch.optim.SGD(grown.parameters(), lr=0.1)
    grown.logits(grown(ids, tk, tv)).logsumexp(-1).sum().backward()
    assert blk.cross_attn.o_proj.weight.grad.abs().sum() > 0 and blk.mlp.down_proj.weight.grad.abs().sum() > 0
    opt.step()
    opt.zero_grad()
    grown.logits(grown(ids, tk, tv)).logsumexp(-1).sum().backward()
    assert blk.cross_attn.q_proj.weight.grad.abs().sum() > 0 and blk.mlp.gate_proj.weight.grad.abs().sum() > 0


def test_grown_draft_saves_and_loads(tmp_path):
    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target).set_draft_vocab(torch.tensor([3, 8, 99]))
    randomize(draft)
    grown = add_cross_blocks(draft, 2)
    randomize(grown, seed=4)
    assert grown.draft_vocab.tolist() == [3, 8, 99]
    grown.save_pretrained(tmp_path / "grown")
    again = LongSpecDraft.from_pretrained(tmp_path / "grown", target=target)
    assert again.config.extra_cross_blocks == 2 and again.draft_vocab.tolist() == [3, 8, 99]
    ids, tk, tv = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(again.logits(again(ids, tk.float(), tv.float())),
                                   grown.logits(grown(ids, tk.float(), tv.float())), atol=0, rtol=0)
    # without its config.json the geometry is the target's (one block): the loader names the tensors it did not expect
    (tmp_path / "bare").mkdir()
    (tmp_path / "grown" / "model.safetensors").rename(tmp_path / "bare" / "model.safetensors")
    with pytest.raises(ValueError, match="extra_blocks.0.cross_attn.q_proj.weight"):
        LongSpecDraft.from_pretrained(tmp_path / "bare" / "model.safetensors", target=target)


@pytest.mark.parametrize("fp8", [False, True])
def test_draft_with_extra_blocks_decodes_exactly(fp8):
    """The drafting path (packed gate/up of every block, fused linears; float8 copies of every block's linears):
    greedy output equals the target's own."""
    decoder_mod = pytest.importorskip("longspec.decode.decoder")
    target = tiny_target("llama", (4, 2), vocab=32, layers=2, seed=4)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    draft = LongSpecDraft.from_target(target, window=6, extra_cross_blocks=2)
    randomize(draft, seed=5)
    p = torch.randint(0, 32, (13,), generator=torch.Generator().manual_seed(6))
    drafter = LongSpecDrafter(draft, weight_dtype=torch.float8_e4m3fn if fp8 else None)
    out = decoder_mod.SpeculativeDecoder(target, drafter, tree_shape=(8, 8, 8)).generate(
        p[None], max_new_tokens=24, eos_token_id=[])
    want = target.generate(p[None], attention_mask=torch.ones(1, 13, dtype=torch.int64), do_sample=False,
                           max_new_tokens=24)[0, 13:]
    assert out.sequences[0, 13:].tolist() == want.tolist()
    assert max(max(row) for row in out.accept_lengths) >= 2
    packed = draft._packed
    assert len(packed.extra_gate_up) == 2
    assert (packed.fp8 is not None and {"x0.gate_up", "x1.down", "x1.cross_q"} <= packed.fp8.weights.keys()) == fp8


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "1"])
def test_bad_block_count_is_refused(bad):
    draft = LongSpecDraft.from_target(tiny_target("llama", (4, 2)))
    with pytest.raises(ValueError, match=r"blocks must be an int >= 1, got"):
        add_cross_blocks(draft, bad)


def test_negative_extra_blocks_in_a_config_are_refused():
    # transformers' strict config wraps the validator's ValueError in its own validation error
    with pytest.raises(Exception, match=r"extra_cross_blocks must be an int >= 0, got -1"):
        LongSpecDraftConfig(hidden_size=64, num_attention_heads=4, extra_cross_blocks=-1)
