"""``beam_topk``'s Triton kernels against the PyTorch reference: exact parents and columns, scores to float32 rounding.

Without a GPU the kernels run under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``).
Logits are random (no two pairs tie except where a case makes them tie on purpose: there the tie order decides).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from longspec_ops.kernels import beam as K  # noqa: E402
from longspec_ops.reference import beam as ref  # noqa: E402

from .test_triton_kernels import DEVICE, DTYPES, _interpreter_loop_bounds  # noqa: E402,F401


def _check(logits: torch.Tensor, cum: torch.Tensor, width: int) -> None:
    parent, column, score = K.beam_topk(logits, cum, width)
    want = ref.beam_topk(logits.cpu(), cum.cpu(), width)
    assert parent.dtype == column.dtype == torch.int64 and score.dtype == torch.float32
    assert torch.equal(parent.cpu(), want[0]) and torch.equal(column.cpu(), want[1])
    assert (score.cpu() - want[2]).abs().max().item() <= 4e-6 * (1 + want[2].abs().max().item())


# (B, P, V, width): the root level (P = 1), a level of the 4-16-16 tree, V off the chunk size (several chunks, a
# ragged last one), width above V (every column of a row), width = P * V (every pair).
CASES = [(2, 1, 300, 4), (3, 4, 1000, 16), (2, 16, 1300, 16), (1, 5, 7, 20), (2, 3, 4, 12)]


@pytest.mark.parametrize("B,P,V,width", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, B, P, V, width):
    g = torch.Generator().manual_seed(B * 1000 + P * 10 + V)
    logits = (torch.randn(B, P, V, generator=g) * 3).to(DEVICE, dtype)
    cum = torch.randn(B, P, generator=g).to(DEVICE)
    _check(logits, cum, width)


def test_ties_go_to_the_lower_parent_then_column():
    """Equal logits and equal parents: every score ties, so the choice is the tie order alone."""
    logits = torch.zeros(2, 3, 50, device=DEVICE)
    cum = torch.zeros(2, 3, device=DEVICE)
    cum[1, 0] = -1.0  # row 1: parent 0 is worse, parents 1 and 2 tie
    parent, column, _ = K.beam_topk(logits, cum, 10)
    assert parent[0].tolist() == [0] * 10 and column[0].tolist() == list(range(10))
    assert parent[1].tolist() == [1] * 10 and column[1].tolist() == list(range(10))
    _check(logits, cum, 10)
    _check(logits, cum, 120)  # across parents: (1, *) then (2, *) then (0, *)


def test_strided_logits_and_many_candidates(monkeypatch):
    """Logits as a view (the drafter slices a level out of a wider buffer), and the select kernel's looped path
    (candidates that do not fit its registers)."""
    monkeypatch.setattr(K, "_MAX_CANDIDATES_IN_REGISTERS", 64)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 6, 700, generator=g).to(DEVICE)
    cum = torch.randn(2, 6, generator=g).to(DEVICE)
    _check(wide[:, 1:5, :600], cum[:, 1:5], 20)
    assert K.plan(4, 600, 20).candidates(4) > 64  # the looped path ran


def test_plan_keeps_candidates_in_registers_at_model_sizes():
    """A 16-parent level of the 69-node tree over Llama-3's 128k vocabulary or a 32k drafting vocabulary: one select
    program holds every candidate."""
    for V in (2048, 32768, 128256, 151936):
        p = K.plan(16, V, 16)
        assert p.candidates(16) <= K._MAX_CANDIDATES_IN_REGISTERS and p.chunk * p.chunks >= V and p.k1 == 16
