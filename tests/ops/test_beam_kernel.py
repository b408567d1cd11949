"""``beam_topk``'s Triton kernels against the PyTorch reference: exact parents and columns, scores to float32 rounding.

Without a GPU the kernels run under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``).
Logits are random (no two pairs tie except where a case makes them tie on purpose: there the tie order decides).
"""
from __future__ import annotations

import dataclasses

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


# The threshold selection (kernels/beam.py, SELECT_THRESHOLD) in each kernel alone and in both.
SELECTS = [(K.SELECT_THRESHOLD, K.SELECT_THRESHOLD), (K.SELECT_THRESHOLD, K.SELECT_ROUNDS),
           (K.SELECT_ROUNDS, K.SELECT_THRESHOLD)]


def _check_plan(logits: torch.Tensor, cum: torch.Tensor, width: int, selects=SELECTS[0], **knobs) -> None:
    B, P, V = logits.shape
    bp = K.plan(P, V, width, chunk_select=selects[0], row_select=selects[1], **knobs)
    assert (bp.chunk_select, bp.row_select) == tuple(selects)
    parent, column, score = K.beam_topk(logits, cum, width, bp)
    want = ref.beam_topk(logits.cpu(), cum.cpu(), width)
    assert torch.equal(parent.cpu(), want[0]) and torch.equal(column.cpu(), want[1]), bp
    finite = want[2].isfinite()
    assert torch.equal(score.cpu().isfinite(), finite) and torch.equal(score.cpu()[~finite], want[2][~finite])
    err = (score.cpu() - want[2])[finite].abs().max().item() if finite.any() else 0.0
    assert err <= 4e-6 * (1 + want[2][finite].abs().max().item()), bp


@pytest.mark.parametrize("selects", SELECTS)
@pytest.mark.parametrize("B,P,V,width", CASES + [(1, 1, 700, 1), (2, 4, 2, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_matches_reference(dtype, B, P, V, width, selects):
    """Random logits (the cases above, width 1, width = P * V over 2 columns): the threshold path's exactly-K and
    compacting branches, and the select kernel's small-set ranking (<= S candidates)."""
    g = torch.Generator().manual_seed(B * 1000 + P * 10 + V + 7)
    logits = (torch.randn(B, P, V, generator=g) * 3).to(DEVICE, dtype)
    cum = torch.randn(B, P, generator=g).to(DEVICE)
    _check_plan(logits, cum, width, selects)


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_ties_and_infinities(dtype):
    """Quantised logits (many equal values at the top), -inf columns (a masked vocabulary), equal rows, equal
    parents: the tie order alone decides, in every branch."""
    g = torch.Generator().manual_seed(11)
    B, P, V = 3, 5, 1100
    logits = (torch.randn(B, P, V, generator=g) * 2).round() / 2  # steps of 0.5: dozens of ties at each value
    logits[0, :, ::3] = float("-inf")
    logits[1] = 0.75  # every pair of batch row 1 ties (its parents too, below)
    logits[2, 1, 40:] = float("-inf")  # parent 1 of row 2: 40 finite columns, then chunks of -inf only (ties)
    cum = torch.randn(B, P, generator=g)
    cum[1] = -2.0
    cum[2, 1] = 5.0  # parent 1 far ahead: its 40 finite columns lead row 2
    logits, cum = logits.to(DEVICE, dtype), cum.to(DEVICE)
    for width in (1, 4, 16, 64):
        _check_plan(logits, cum, width)
    for selects in SELECTS[1:]:
        _check_plan(logits, cum, 16, selects)


def test_threshold_every_pair_and_few_columns():
    """width = P * V (every pair, so the last slots hold -inf scores and the padding of K1 to a power of two), and
    rows with fewer valid columns than K1 (the chunk kernel pads its list with no-candidate keys)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 5, generator=g).to(DEVICE)
    logits[0, 1, 2] = float("-inf")
    cum = torch.randn(2, 3, generator=g).to(DEVICE)
    _check_plan(logits, cum, 15)  # k1 = 8 > V = 5
    for width in (3, 5, 7, 12):
        _check_plan(logits, cum, width)


def test_threshold_strided_logits_and_many_candidates(monkeypatch):
    """A logits view, and candidates past the select kernel's registers: its looped path (the rounds) after the
    chunk kernel's threshold path."""
    monkeypatch.setattr(K, "_MAX_CANDIDATES_IN_REGISTERS", 64)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 6, 700, generator=g).to(DEVICE)
    cum = torch.randn(2, 6, generator=g).to(DEVICE)
    _check_plan(wide[:, 1:5, :600], cum[:, 1:5], 20)


@pytest.fixture
def branches(monkeypatch):
    """Counts the threshold path's branches (interpreter only: on a GPU the kernels are compiled, and a Python wrapper
    cannot be called from them): ``compact`` the compacting branch of either kernel, ``chunk_rounds`` /
    ``select_rounds`` each kernel's fallback to the rounds."""
    from .test_triton_kernels import INTERPRET

    if not INTERPRET:
        pytest.skip("counts calls inside the kernels, which only the interpreter runs as Python")
    calls = {"compact": 0, "chunk_rounds": 0, "select_rounds": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(K, "_compact", counted("compact", K._compact))
    monkeypatch.setattr(K, "_chunk_rounds", counted("chunk_rounds", K._chunk_rounds))
    monkeypatch.setattr(K, "_select_rounds", counted("select_rounds", K._select_rounds))
    return calls


def test_threshold_branches(branches, monkeypatch):
    """Each branch runs and is exact: random rows take the exactly-K or the compacting branch and never the rounds;
    rows whose top values crowd into a few of the chunk kernel's groups (columns = 0 .. 15 mod 64) and tiny survivor
    slots (S = G = K: nearly every row overflows) take the rounds."""
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(2, 16, 1300, generator=g) * 3).to(DEVICE)
    cum = torch.randn(2, 16, generator=g).to(DEVICE)
    _check_plan(logits, cum, 16)
    assert branches["compact"] > 0 and branches["chunk_rounds"] == branches["select_rounds"] == 0, branches
    # 2 rows x 16 parents x 3 chunks + 2 select programs; fewer compacting calls: some took the exactly-K branch.
    assert branches["compact"] < 2 * 16 * 3 + 2, branches

    col = torch.arange(1024)
    crowded = torch.where(col % 64 < 16, 100.0 - (col % 64).float(), torch.randn(2, 1024, generator=g))
    _check_plan(crowded[None].to(DEVICE), torch.zeros(1, 2, device=DEVICE), 16)
    assert branches["chunk_rounds"] == 4, branches  # both chunks of both parents

    monkeypatch.setattr(K, "_threshold_sizes", lambda k: (K.triton.next_power_of_2(k),) * 2)
    _check_plan(logits, cum, 16)
    assert branches["select_rounds"] == 2, branches


def test_plan_selects():
    """The threshold selection pads K1 to a power of two (its lists divide the select kernel's groups) and gives way
    to the rounds past _THRESHOLD_MAX_K kept; the rounds keep K1 = min(width, V, chunk)."""
    assert K.plan(4, 1000, 20, chunk_select=K.SELECT_ROUNDS, row_select=K.SELECT_ROUNDS).k1 == 20
    assert K.plan(4, 1000, 4).k1 == 4  # below _THRESHOLD_FROM_K: the rounds
    p = K.plan(4, 1000, 20, chunk_select=K.SELECT_THRESHOLD, row_select=K.SELECT_ROUNDS)
    assert p.k1 == 32 and (p.chunk_select, p.row_select) == (K.SELECT_THRESHOLD, K.SELECT_ROUNDS)
    assert K.plan(4, 5, 20, row_select=K.SELECT_THRESHOLD).k1 == 8
    big = K.plan(4, 1000, K._THRESHOLD_MAX_K + 1, chunk_select=K.SELECT_THRESHOLD, row_select=K.SELECT_THRESHOLD)
    assert (big.chunk_select, big.row_select, big.k1) == (K.SELECT_ROUNDS, K.SELECT_ROUNDS, K._THRESHOLD_MAX_K + 1)
    with pytest.raises(ValueError):
        K.plan(4, 1000, 16, row_select=2)
    for V in (2048, 32768, 128256, 151936):  # chunks of at most 8192 columns, unless that overflows the registers
        p = K.plan(16, V, 16, chunk_select=K.SELECT_THRESHOLD, row_select=K.SELECT_THRESHOLD)
        assert p.candidates(16) <= K._MAX_CANDIDATES_IN_REGISTERS and p.chunk * p.chunks >= V and p.k1 == 16
        assert p.chunk <= K._MAX_CHUNK_THRESHOLD or V == 151936


def test_plan_select_block(monkeypatch):
    """The select program holds the candidates in registers up to ``max_in_registers`` (its block: the next power of
    two), else loops through a scratch buffer (block 0); the launch takes the plan's block; a plan whose block cannot
    hold its candidates is refused."""
    launches = []
    kernel = K._beam_select_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["IN_REGISTERS"], kwargs["BLOCK"]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(K, "_beam_select_kernel", Recorded())
    assert K.plan(16, 128256, 16).select_block == 4096
    small = K.plan(12, 128256, 12, target_candidates=8192, max_in_registers=8192)
    assert (small.chunk, small.candidates(12), small.select_block) == (4096, 6144, 8192)
    assert K.plan(12, 128256, 12, target_candidates=8192).select_block == 0  # past the default 4096: looped
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 4, 600, generator=g).to(DEVICE)
    cum = torch.randn(1, 4, generator=g).to(DEVICE)
    _check_plan(logits, cum, 20, max_in_registers=64)  # 4 x 2 x 32 candidates: the looped path
    _check_plan(logits, cum, 20)  # in registers
    assert launches == [(False, K._SELECT_BLOCK), (True, K.plan(4, 600, 20).select_block)], launches
    bp = K.plan(4, 600, 20)
    with pytest.raises(ValueError, match="select_block"):
        K.beam_topk(logits, cum, 20, dataclasses.replace(bp, select_block=bp.select_block // 2))
