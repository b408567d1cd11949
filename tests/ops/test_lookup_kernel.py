"""``prompt_lookup_chain``'s Triton kernel against its PyTorch reference: exact token ids.

Without a GPU the kernel runs under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from longspec_ops.kernels import lookup as K  # noqa: E402
from longspec_ops.reference import lookup as ref  # noqa: E402

from .test_triton_kernels import DEVICE, _interpreter_loop_bounds  # noqa: E402,F401


def _texts(B: int, C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of small alphabets (matches of every length, short periods, rows with no repeat) and roots anywhere."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.stack([torch.randint(0, 2 + b % 7, (C,), generator=g) for b in range(B)])
    tokens[0] = torch.arange(C)  # no n-gram repeats: no match
    seqlens = torch.randint(0, C, (B,), generator=g, dtype=torch.int32)
    seqlens[1], seqlens[2] = 0, C - 1  # a root with no text before it; the last column
    return tokens.to(DEVICE), seqlens.to(DEVICE)


@pytest.mark.parametrize("min_n,max_n", [(1, 3), (2, 2), (1, 1), (2, 4)])
@pytest.mark.parametrize("depth", [1, 6, 17])
def test_chain_matches_reference(depth, min_n, max_n):
    tokens, seqlens = _texts(12, 37, seed=depth * 10 + min_n + max_n)
    got = K.prompt_lookup_chain(tokens, seqlens, depth, min_n, max_n)
    want = ref.prompt_lookup_chain(tokens.cpu(), seqlens.cpu(), depth, min_n, max_n)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert not want[1][0] and not want[1][1]  # the rows without a match are checked too


def test_chain_spans_blocks_and_repeats_the_period(monkeypatch):
    """Texts wider than the kernel's block and chunk (the best across blocks and across programs: an early long
    match beats a later short one), and the period rule: the latest match one period back repeats that period."""
    monkeypatch.setattr(K, "BLOCK", 8)
    monkeypatch.setattr(K, "CHUNK", 16)
    C = 70
    tokens = torch.randint(10, 40, (3, C), generator=torch.Generator().manual_seed(1))
    tokens[0, 3:6] = torch.tensor([1, 2, 3])  # the only 3-gram match, in the first block; continues with 4 ...
    tokens[0, 6] = 4
    tokens[0, 60:63] = torch.tensor([1, 2, 3])  # the root's 3-gram
    tokens[1, 50:62] = torch.tensor([5, 6, 7] * 4)  # period 3 up to the root at 61
    seqlens = torch.tensor([62, 61, 69], dtype=torch.int32)
    tokens[0, 61:63] = torch.tensor([2, 3])  # keep the suffix "1 2 3" ending at the root (column 62)
    tokens[0, 60] = 1
    tokens, seqlens = tokens.to(DEVICE), seqlens.to(DEVICE)
    chain, found = K.prompt_lookup_chain(tokens, seqlens, 8, 1, 3)
    want = ref.prompt_lookup_chain(tokens.cpu(), seqlens.cpu(), 8, 1, 3)
    assert torch.equal(chain.cpu(), want[0]) and torch.equal(found.cpu(), want[1])
    assert chain[0, :2].tolist() == [3, 4]
    assert chain[1].tolist() == [7, 5, 6, 7, 5, 6, 7, 5, 6]


def test_kernel_clamps_bad_lengths():
    """The raw CUDA op reads no values on the host; its kernel clamps a root column outside the row into it (the
    checked wrappers and the CPU op reject it instead)."""
    tokens = _texts(3, 20, seed=9)[0][:2]
    bad = torch.tensor([-3, 25], dtype=torch.int32, device=DEVICE)
    got = K.prompt_lookup_chain(tokens, bad, 5, 1, 3)
    want = ref.prompt_lookup_chain(tokens.cpu(), torch.tensor([0, 19], dtype=torch.int32), 5, 1, 3)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
