"""Growing a trained draft without changing what it computes: a wider MLP whose new units start silent, so that a
draft whose held-out loss has stopped falling can train on with more capacity from where it stands."""
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
    from longspec.model.draft import LongSpecDraft

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
    with torch.device("meta"):
        wide = LongSpecDraft(config)
    wide.load_state_dict(state, strict=True, assign=True)
    wide.train(draft.training).bind_target(draft.target)
    if draft.draft_vocab is not None:
        wide.set_draft_vocab(draft.draft_vocab)
    return wide
