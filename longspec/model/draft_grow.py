"""Growing a trained draft without changing what it computes: a wider MLP whose new units start silent, or extra
cross-attention blocks that start as the identity, so that a draft whose held-out loss has stopped falling can train
on with more capacity from where it stands."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from longspec.model.draft import LongSpecDraft


def widen_mlp(draft: "LongSpecDraft", intermediate_size: int, *, seed: int = 0) -> "LongSpecDraft":
    """A copy of ``draft`` whose MLP has ``intermediate_size`` units (more than its own).

    The first ``draft.config.intermediate_size`` units are the trained ones. The new units' gate and up rows are
    drawn as a fresh draft's are (normal, std ``initializer_range``, from ``seed``) and their ``down_proj``
    columns are zero, so the copy computes the same function (up to the order of float sums) and training brings
    the new units in: their down columns get gradients at once, their gate/up rows from the first update on. The
    copy is bound to the same target, in the same dtype, device and train/eval mode, with the same drafting
    vocabulary; ``draft`` is left as it was.
    """
    old = draft.config.intermediate_size
    if isinstance(intermediate_size, bool) or not isinstance(intermediate_size, int) or intermediate_size <= old:
        raise ValueError(f"intermediate_size must be an int larger than the draft's ({old}), got "
                         f"{intermediate_size!r}")
    config = copy.deepcopy(draft.config)
    config.intermediate_size = intermediate_size
    extra, hidden = intermediate_size - old, config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    state = {name: t.detach().clone() for name, t in draft.state_dict().items()}
    for name in ("gate", "up"):
        w = state[f"mlp.{name}_proj.weight"]
        fresh = torch.randn(extra, hidden, generator=gen, dtype=torch.float32) * config.initializer_range
        state[f"mlp.{name}_proj.weight"] = torch.cat([w, fresh.to(w)], 0)
        if config.mlp_bias:
            b = state[f"mlp.{name}_proj.bias"]
            state[f"mlp.{name}_proj.bias"] = torch.cat([b, b.new_zeros(extra)])
    down = state["mlp.down_proj.weight"]
    state["mlp.down_proj.weight"] = torch.cat([down, down.new_zeros(hidden, extra)], 1)
    return _rebuilt(draft, config, state)


def _rebuilt(draft: "LongSpecDraft", config, state: dict) -> "LongSpecDraft":
    """A draft of ``config`` holding ``state``, bound to ``draft``'s target, in its mode and drafting vocabulary."""
    from longspec.model.draft import LongSpecDraft

    with torch.device("meta"):
        grown = LongSpecDraft(config)
    grown.load_state_dict(state, strict=True, assign=True)
    grown.train(draft.training).bind_target(draft.target)
    if draft.draft_vocab is not None:
        grown.set_draft_vocab(draft.draft_vocab)
    return grown


def add_cross_blocks(draft: "LongSpecDraft", blocks: int, *, seed: int = 0) -> "LongSpecDraft":
    """A copy of ``draft`` with ``blocks`` more extra cross-attention + MLP blocks
    (:class:`~longspec.model.draft_blocks.CrossBlock`) after its own, computing the same function.

    The new blocks' weights are drawn as a fresh draft's are (from ``seed``), their norms are ones, and their two
    output projections (``cross_attn.o_proj``, ``mlp.down_proj``) are zero, so each new block starts as the
    identity and training brings it in: the output projections get gradients at once, the rest from the first
    update on. Bound to the same target, in the same dtype, device and train/eval mode, with the same drafting
    vocabulary; ``draft`` is left as it was.
    """
    from longspec.model.draft_blocks import CrossBlock

    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"blocks must be an int >= 1, got {blocks!r}")
    config = copy.deepcopy(draft.config)
    old = config.extra_cross_blocks
    config.extra_cross_blocks = old + blocks
    gen = torch.Generator().manual_seed(seed)
    state = {name: t.detach().clone() for name, t in draft.state_dict().items()}
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in CrossBlock(config).state_dict().items()}
    for i in range(old, old + blocks):
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                t = torch.ones(shape)
            elif name.endswith(".bias") or name in ("cross_attn.o_proj.weight", "mlp.down_proj.weight"):
                t = torch.zeros(shape)
            else:  # q_proj, gate_proj, up_proj: a fresh draft's normal init
                t = torch.randn(shape, generator=gen) * config.initializer_range
            state[f"extra_blocks.{i}.{name}"] = t
    ref = next(draft.parameters())
    return _rebuilt(draft, config, {name: t.to(device=ref.device, dtype=ref.dtype) for name, t in state.items()})
