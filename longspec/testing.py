"""Helpers for checking losslessness on your own models and drafters.

Exact token equality is the test at float32. In bf16 (or any low precision), speculative and plain decoding run
different kernels (a tree-verify forward against single-token decode steps), so near-ties of the next-token logits
may flip; :func:`first_divergence` locates where two outputs part and measures how close to a tie that point was
under a higher-precision copy of the target, so a test can require that outputs differ only at genuine ties.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Divergence:
    """Where two generated batches first differ, and the reference model's top-2 logit margin there."""

    row: int
    column: int
    margin: float


def first_difference(got: Tensor, want: Tensor) -> Optional[int]:
    """The first column (over all rows) at which two token batches ``[B, T]`` differ; the shorter width when one is
    a prefix of the other; None when they are equal."""
    if got.shape == want.shape and torch.equal(got, want):
        return None
    width = min(got.shape[-1], want.shape[-1])
    differ = (got[..., :width] != want[..., :width]).nonzero()
    return int(differ[:, -1].min()) if len(differ) else width


@torch.no_grad()
def first_divergence(got: Tensor, want: Tensor, reference_model, attention_mask: Optional[Tensor] = None
                     ) -> Optional[Divergence]:
    """None when ``got`` equals ``want`` (int64 ``[B, S + G]``); else the first differing (row, column) and the
    top-2 logit margin of ``reference_model`` (e.g. a float32 copy of the target) on the agreed prefix.

    ``attention_mask`` (``[B, S]``, 1 = token) marks left padding of the prompt, as given to ``generate``.
    """
    if got.shape == want.shape and torch.equal(got, want):
        return None
    width = min(got.shape[1], want.shape[1])
    diff = (got[:, :width] != want[:, :width]).nonzero()
    if len(diff) == 0:  # one is a prefix of the other: no next-token choice to measure
        return Divergence(0, width, float("nan"))
    b, t = diff[0].tolist()
    prefix = want[b:b + 1, :t]
    if attention_mask is None:
        mask = torch.ones_like(prefix)
    else:
        S = attention_mask.shape[1]
        mask = torch.cat([attention_mask[b:b + 1, :t], prefix.new_ones(1, max(0, t - S))], dim=1)
    logits = reference_model(prefix, attention_mask=mask).logits[0, -1].float()
    top2 = logits.topk(2).values
    return Divergence(b, t, float(top2[0] - top2[1]))
