"""The Gluon sm_90 split-KV kernel (``longspec_ops/kernels/attention_sm90.py``) without a GPU.

Gluon has no CPU interpreter, so the kernel's numerics are tested on the H200 (``tests/ops/test_gpu_attention.py``:
every many-row hybrid/prefix case with two or more KV splits runs it). Here it is compiled offline for sm_90a with
the installed Triton and the ptxas it ships (``tests/ops/sm90_offline.py``, in a process without the interpreter),
and the machine code is checked for what the kernel's speed rests on: two programs fit on one SM (registers,
shared memory, no spills), and each key block's exponentials are issued between the wait for its scores and the
wait for the previous block's P @ V, i.e. while that wgmma runs. (The second wait has no data dependence on the
softmax; without the kernel's pin, ptxas hoists it above them.) The host-side kernel choice is checked with a
stubbed device capability.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from longspec_ops.kernels import attention as K  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SMEM_PER_SM = 228 * 1024  # H100/H200: 228 KiB per SM, 1 KiB of it reserved per resident block
_REGS_PER_SM = 64 * 1024


@pytest.mark.parametrize("D,dtype", [(128, "bf16"), (64, "fp16")])
def test_two_programs_fit_per_sm_and_softmax_overlaps_pv(D, dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.ops.sm90_offline", str(D), dtype], cwd=_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["stack"] == 0 and r["local"] == 0, f"register spills: {r}"
    assert r["occupancy"] * r["regs"] * r["threads"] <= _REGS_PER_SM, f"fewer than {r['occupancy']} programs/SM: {r}"
    assert r["occupancy"] * (r["shared"] + 1024) <= _SMEM_PER_SM, f"fewer than {r['occupancy']} programs/SM: {r}"
    exps_per_block = 64 * r["block_n"] // r["threads"]  # the exponentials one thread computes for one key block
    assert r["overlapped_exps"] and max(r["overlapped_exps"]) >= exps_per_block, (
        f"no block's softmax runs while the previous block's P @ V is in flight: {r}")


def test_kernel_choice(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(K, "_capability", lambda device: (9, 0))
    assert K.split_config(128, 296, torch.bfloat16, cuda) is K._SM90_SPLIT  # tree verification: Gluon
    assert K.split_config(64, 69, torch.float16, cuda) is K._SM90_SPLIT
    assert not K.split_config(128, 64, torch.bfloat16, cuda).wgmma  # decode-sized tiles stay in Triton
    assert not K.split_config(128, 296, torch.float32, cuda).wgmma
    assert not K.split_config(96, 296, torch.float16, cuda).wgmma
    assert not K.split_config(128, 296, torch.bfloat16).wgmma  # no device: the Triton table
    monkeypatch.setattr(K, "_capability", lambda device: (10, 0))
    assert not K.split_config(128, 296, torch.bfloat16, cuda).wgmma  # wgmma is sm_90 only
    with pytest.raises(ValueError, match="wgmma"):
        K.AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, wgmma=True)
    q = torch.zeros(1, 74, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 4096, 8, 128, dtype=torch.bfloat16)
    assert not K._wgmma_applies(q, kv, kv, torch.zeros(1, dtype=torch.int32), 128, 4)  # CPU tensors: never
