"""``record_acceptance_``'s Triton kernel against its PyTorch reference.

Without a GPU the kernel runs under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``). The
counts are sums of 0/1 weights (exact); the realised means are float32 sums of a few products, compared closely.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from longspec_ops.kernels import stats as K  # noqa: E402
from longspec_ops.reference import stats as ref  # noqa: E402

from .test_triton_kernels import DEVICE, _interpreter_loop_bounds  # noqa: E402,F401


def _round(B: int, T: int, Kopt: int, A: int, cells: int, seed: int, active=None):
    g = torch.Generator().manual_seed(seed)
    state = [torch.rand(cells, generator=g) * 5, torch.rand(cells, generator=g) * 2,
             1 + torch.rand(Kopt, generator=g) * 3, torch.rand(Kopt, generator=g), torch.rand(Kopt, generator=g) < 0.5]
    keys = torch.randint(0, cells, (B, T + 3), generator=g)[:, 1 : T + 1]  # strided; duplicate cells
    within = (torch.rand(B, T, Kopt, generator=g) < 0.4).float()
    contained = torch.rand(Kopt, generator=g) < 0.6
    accept_len = torch.randint(1, A + 1, (B,), generator=g)
    accept_index = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(T - 1, generator=g)[
        : A - 1] + 1]) for _ in range(B)])
    accept_index = torch.cat([accept_index, accept_index], dim=1)[:, :A]  # a strided view, like accept_tree's
    if active is None:
        active = torch.rand(B, generator=g) < 0.7
    inputs = [keys, within, contained, accept_index, accept_len, active]
    return [t.to(DEVICE) for t in state], [t.to(DEVICE) for t in inputs]


@pytest.mark.parametrize("B,T,Kopt,A,cells", [(1, 7, 5, 4, 40), (3, 85, 23, 17, 1088), (5, 20, 9, 6, 300)])
@pytest.mark.parametrize("rows", ["mixed", "none active", "all active"])
def test_record_matches_reference(B, T, Kopt, A, cells, rows, monkeypatch):
    monkeypatch.setattr(K, "BLOCK_N", 16)  # several node steps
    monkeypatch.setattr(K, "BLOCK_C", 256)
    active = {"mixed": None, "none active": torch.zeros(B, dtype=torch.bool),
              "all active": torch.ones(B, dtype=torch.bool)}[rows]
    state, inputs = _round(B, T, Kopt, A, cells, seed=B * 100 + T, active=active)
    want = [t.clone().cpu() for t in state]
    ref.record_acceptance_(*want, *[t.cpu() for t in inputs], 0.99, 0.2)
    K.record_acceptance_(*state, *inputs, 0.99, 0.2)
    for got, exp, name in zip(state, want, ("proposed", "accepted", "realised", "mass", "seen")):
        if name == "seen":
            assert torch.equal(got.cpu(), exp), name
        else:
            torch.testing.assert_close(got.cpu(), exp, rtol=1e-5, atol=1e-5, msg=name)


def test_record_kernel_skips_cells_outside_the_tables():
    """The raw CUDA op reads no values on the host: a node whose cell lies outside the tables is not counted (the
    CPU op rejects it); every other effect of the round is the reference's on the in-range nodes."""
    state, inputs = _round(2, 9, 4, 3, 30, seed=3, active=torch.ones(2, dtype=torch.bool))
    keys = inputs[0].clone()
    keys[0, 3], keys[1, 5] = -1, 30
    inputs_bad = [keys] + inputs[1:]
    want = [t.clone().cpu() for t in state]
    K.record_acceptance_(*state, *inputs_bad, 0.9, 0.2)
    # the reference on a copy of the tables with one spare cell that takes the out-of-range nodes
    spare = [torch.cat([want[0], torch.zeros(1)]), torch.cat([want[1], torch.zeros(1)])] + want[2:]
    ref.record_acceptance_(*spare, *[t.cpu() for t in [keys.clamp(0, 30).masked_fill(keys < 0, 30)] + inputs[1:]],
                           0.9, 0.2)
    torch.testing.assert_close(state[0].cpu(), spare[0][:30], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1].cpu(), spare[1][:30], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[2].cpu(), spare[2], rtol=1e-5, atol=1e-5)
