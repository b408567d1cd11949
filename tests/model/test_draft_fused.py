"""The draft block's drafting path (``longspec::fused_linear``: norms, SwiGLU and residual adds folded into the
linears) against its training path (``nn.Linear`` modules, LlamaRMSNorm, the MLP), phase method by phase method.

On the CPU the two are the same PyTorch ops, so they agree bit for bit. On CUDA the drafting path runs the Triton
kernel (<= 16 rows) or the composed path (more rows) and must stay within twice the training path's own error, both
against a float64 CPU copy of the block (flash-attention's tolerance rule)."""
from __future__ import annotations

import pytest
import torch

from longspec.model.draft import LongSpecDraft

from .draft_reference import randomize, tiny_target

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _phases(draft: LongSpecDraft, x, self_out, cross, cos, sin, drafting: bool) -> dict[str, torch.Tensor]:
    """Each phase method's output on the same inputs, through the drafting path (gradients off) or not."""
    with torch.set_grad_enabled(not drafting):
        q, k, v = draft.self_qkv(x, cos, sin)
        h1 = draft.after_self_attention(x, self_out)
        return {"q": q, "k": k, "v": v, "h1": h1, "cross_q": draft.cross_query(h1, cos, sin),
                "out": draft.after_cross_attention(h1, cross),
                "logits": draft.draft_logits(draft.after_cross_attention(h1, cross))}


@pytest.mark.parametrize("rows", [5, 16, 40], ids=["5 rows", "16 rows", "40 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_drafting_path_matches_the_training_path(device, dtype, rows):
    truth = LongSpecDraft.from_target(tiny_target("llama", (4, 2), hidden=64, vocab=160).double())
    randomize(truth)
    truth = truth.double()
    draft = LongSpecDraft.from_target(tiny_target("llama", (4, 2), hidden=64, vocab=160).to(device, dtype))
    draft.load_state_dict(truth.state_dict())
    draft = draft.to(device, dtype).pack_for_drafting()
    _check_phases(draft, draft, truth, device, dtype, rows, seed=3, bitwise_on_cpu=True)


def _check_phases(draft, plain_model, truth, device, dtype, rows, seed, bitwise_on_cpu):
    """``draft``'s drafting path within twice the error of ``plain_model``'s training path, both against
    ``truth`` (float64) on one batch row of ``rows`` tokens (the linears see `rows` rows: the kernel up to 16, the
    composed path above); on the CPU with ``bitwise_on_cpu`` the two paths must agree bit for bit."""
    c = draft.config
    g = torch.Generator().manual_seed(seed)
    shapes = {"x": (c.hidden_size,), "self_out": (c.num_attention_heads, c.head_dim),
              "cross": (c.num_attention_heads, c.head_dim), "angle": (c.head_dim,)}
    x, self_out, cross, angle = (torch.randn(1, rows, *s, generator=g, dtype=torch.float64) for s in shapes.values())
    want = _phases(truth, x, self_out, cross, angle.cos(), angle.sin(), drafting=False)
    args = [t.to(device, dtype) for t in (x, self_out, cross, angle.cos(), angle.sin())]
    fused = _phases(draft, *args, drafting=True)
    plain = _phases(plain_model, *args, drafting=False)
    for name, w in want.items():
        f, p = fused[name].detach(), plain[name].detach()
        assert f.shape == w.shape and f.dtype == dtype, name
        if device == "cpu" and bitwise_on_cpu:
            assert torch.equal(f, p), name
            continue
        err = (f.double().cpu() - w).abs().max().item()
        ref_err = (p.double().cpu() - w).abs().max().item()
        floor = 1e-5 if dtype == torch.float32 else 1e-2
        assert err <= 2 * ref_err + floor, (name, err, ref_err)


def _dequantized_copy(draft: LongSpecDraft, dtype: torch.dtype, device="cpu") -> LongSpecDraft:
    """A copy of ``draft`` (and of its target's LM head) in ``dtype`` on ``device`` whose every drafting weight is
    the float8 copy's dequantized value ``w8 * scale``: the block the float8 drafting path computes. (The target
    is made on ``device``: a draft's ``.to`` does not move the target it is bound to.)"""
    fp8 = draft._packed.fp8.weights
    deq = {name: (w8.double() * s.double()[:, None]).to(device, dtype) for name, (w8, s) in fp8.items()}
    target = tiny_target("llama", (4, 2), hidden=64, vocab=160).to(device, dtype)
    copy = LongSpecDraft.from_target(target)
    copy.load_state_dict({k: v.to(device, dtype) for k, v in draft.state_dict().items()})
    with torch.no_grad():
        sa, mlp, d = copy.self_attn, copy.mlp, copy.config.head_dim
        q, k, v = deq["qkv"].split([sa.num_heads * d, sa.num_kv_heads * d, sa.num_kv_heads * d])
        sa.q_proj.weight.copy_(q), sa.k_proj.weight.copy_(k), sa.v_proj.weight.copy_(v)
        sa.o_proj.weight.copy_(deq["self_o"])
        copy.cross_attn.q_proj.weight.copy_(deq["cross_q"])
        copy.cross_attn.o_proj.weight.copy_(deq["cross_o"])
        gate, up = deq["gate_up"].chunk(2)
        mlp.gate_proj.weight.copy_(gate), mlp.up_proj.weight.copy_(up)
        mlp.down_proj.weight.copy_(deq["down"])
        target.get_output_embeddings().weight.copy_(deq["head"])
    return copy


@pytest.mark.parametrize("rows", [5, 16], ids=["5 rows", "16 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_drafting_path_is_the_block_with_dequantized_weights(device, dtype, rows):
    """``pack_for_drafting(torch.float8_e4m3fn)``: every phase within twice the error of the same-dtype block whose
    weights are the dequantized float8 copies (training path), both against that block in float64."""
    draft = LongSpecDraft.from_target(tiny_target("llama", (4, 2), hidden=64, vocab=160).to(device, dtype))
    randomize(draft)
    draft = draft.to(device, dtype).pack_for_drafting(torch.float8_e4m3fn)
    assert draft._packed.fp8 is not None and draft._packed.fp8.weights["gate_up"][0].dtype == torch.float8_e4m3fn
    truth = _dequantized_copy(draft, torch.float64)
    same = _dequantized_copy(draft, dtype, device)
    _check_phases(draft, same, truth, device, dtype, rows, seed=4, bitwise_on_cpu=False)


def test_fp8_copies_follow_the_weights():
    """The float8 copies are dropped when a source weight changes in place or the drafting vocabulary changes, and
    made again at the next packing; packing without a dtype drops them."""
    draft = LongSpecDraft.from_target(tiny_target("llama", (4, 2), hidden=64, vocab=160))
    draft.pack_for_drafting(torch.float8_e4m3fn)
    fp8 = draft._packed.fp8
    w8, scale = fp8.weights["down"]
    before = scale.clone()
    draft.pack_for_drafting(torch.float8_e4m3fn)
    assert draft._packed.fp8 is fp8 and fp8.current()  # nothing changed: nothing redone
    with torch.no_grad():
        draft.mlp.down_proj.weight.mul_(2.0)  # an optimiser step writes in place
    assert not fp8.current()
    draft.pack_for_drafting(torch.float8_e4m3fn)
    # requantized into the same tensors (captured graphs read them), to the new values
    assert draft._packed.fp8 is fp8 and fp8.weights["down"][0] is w8 and fp8.weights["down"][1] is scale
    assert torch.equal(scale, 2.0 * before) and fp8.current()
    draft.set_draft_vocab(torch.arange(0, 160, 2))
    assert draft._packed.fp8 is None
    draft.pack_for_drafting(torch.float8_e4m3fn)
    assert draft._packed.fp8.weights["head"][0].shape == (80, 64)
    draft.pack_for_drafting()
    assert draft._packed.fp8 is None
    with pytest.raises(ValueError, match="pack_for_drafting: weight_dtype must be None"):
        draft.pack_for_drafting(torch.float16)
    from longspec import LongSpecDrafter

    with pytest.raises(ValueError, match="LongSpecDrafter: weight_dtype must be None"):
        LongSpecDrafter(draft, weight_dtype=torch.int8)
