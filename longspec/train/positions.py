"""Anchor-offset position indices (LongSpec section 3.2): train on short sequences, see long-context positions.

The first ``sink`` tokens (sink uniform on 0..max_sink) keep positions 0..sink-1, the attention sinks every
long-context model keeps; the remaining tokens get one shared random offset, uniform on 0..max_positions - seq_len,
so the packed sequence's positions reach as far as the target supports. The same positions feed the target (its
last-layer keys are rotated there) and the draft. ``enabled=False`` gives plain 0..seq_len-1 (the ablation).
"""
from __future__ import annotations

import torch


def anchor_offset_positions(
    seq_len: int, max_positions: int, generator: torch.Generator, max_sink: int = 4, enabled: bool = True
) -> torch.Tensor:
    """int64 [seq_len] positions for one micro-batch (shared by its rows), all below ``max_positions``."""
    if seq_len > max_positions:
        raise ValueError(f"seq_len ({seq_len}) exceeds the target's max_position_embeddings ({max_positions})")
    pos = torch.arange(seq_len, dtype=torch.long)
    if not enabled:
        return pos
    sink = int(torch.randint(0, max_sink + 1, (1,), generator=generator))
    offset = int(torch.randint(0, max_positions - seq_len + 1, (1,), generator=generator))
    pos[sink:] += offset
    return pos
