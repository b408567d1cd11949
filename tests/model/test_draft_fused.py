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
    c = draft.config
    g = torch.Generator().manual_seed(3)
    shapes = {"x": (c.hidden_size,), "self_out": (c.num_attention_heads, c.head_dim),
              "cross": (c.num_attention_heads, c.head_dim), "angle": (c.head_dim,)}
    # one batch row of `rows` tokens: the linears see `rows` rows, the kernel up to 16, the composed path above
    x, self_out, cross, angle = (torch.randn(1, rows, *s, generator=g, dtype=torch.float64) for s in shapes.values())
    want = _phases(truth, x, self_out, cross, angle.cos(), angle.sin(), drafting=False)
    args = [t.to(device, dtype) for t in (x, self_out, cross, angle.cos(), angle.sin())]
    fused = _phases(draft, *args, drafting=True)
    plain = _phases(draft, *args, drafting=False)
    for name, w in want.items():
        f, p = fused[name].detach(), plain[name].detach()
        assert f.shape == w.shape and f.dtype == dtype, name
        if device == "cpu":
            assert torch.equal(f, p), name
            continue
        err = (f.double().cpu() - w).abs().max().item()
        ref_err = (p.double().cpu() - w).abs().max().item()
        floor = 1e-5 if dtype == torch.float32 else 1e-2
        assert err <= 2 * ref_err + floor, (name, err, ref_err)
