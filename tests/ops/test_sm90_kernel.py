"""The Gluon sm_90 split-KV kernel (``longspec_ops/kernels/attention_sm90.py``) without a GPU.

Gluon has no CPU interpreter, so the kernel's numerics are tested on the H200 (``tests/ops/test_gpu_attention.py``:
every many-row hybrid/prefix case with two or more KV splits runs it). Here it is compiled offline for sm_90a with
the installed Triton and the ptxas it ships (``tests/ops/sm90_offline.py``, in a process without the interpreter),
and the machine code is checked for what the kernel's speed rests on: two programs fit on one SM (registers,
shared memory, no spills), and each key block's exponentials are issued between the wait for its scores and the
wait for the previous block's P @ V, i.e. while that wgmma runs (the second wait has no data dependence on the
softmax; without the kernel's pin, ptxas hoists it above them), and that softmax shuffles only for the row max
(the row sums stay per lane until after the last block; checked to fail when they are reduced per block). The
host-side kernel choice is checked with a stubbed device capability.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from longspec_ops.kernels import configs as C  # noqa: E402
from longspec_ops.kernels import launch as K  # noqa: E402

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
    rows_per_thread = 64 * 4 // r["threads"]  # 64 rows; a row spans the 4 lanes of a quad
    assert max(r["overlapped_shuffles"]) <= 2 * rows_per_thread, (
        f"the per-block softmax shuffles more than the row max needs (row sums should stay per lane): {r}")


def test_kernel_choice(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(C, "_capability", lambda device: (9, 0))
    assert C.split_config(128, 296, torch.bfloat16, cuda) is C._SM90_SPLIT  # tree verification: Gluon
    assert C.split_config(64, 69, torch.float16, cuda) is C._SM90_SPLIT
    assert not C.split_config(128, 64, torch.bfloat16, cuda).wgmma  # decode-sized tiles stay in Triton
    assert not C.split_config(128, 296, torch.float32, cuda).wgmma
    assert not C.split_config(96, 296, torch.float16, cuda).wgmma
    assert not C.split_config(128, 296, torch.bfloat16).wgmma  # no device: the Triton table
    monkeypatch.setattr(C, "_capability", lambda device: (10, 0))
    assert not C.split_config(128, 296, torch.bfloat16, cuda).wgmma  # wgmma is sm_90 only
    with pytest.raises(ValueError, match="wgmma"):
        C.AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, wgmma=True)
    q = torch.zeros(1, 74, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 4096, 8, 128, dtype=torch.bfloat16)
    assert not K._wgmma_applies(q, kv, kv, torch.zeros(1, dtype=torch.int32), 128, 4)  # CPU tensors: never



def test_launcher_binds_every_kernel_argument(monkeypatch):
    """The host path to the Gluon kernel against the kernel's signature (the launch itself needs an sm_90 GPU, so
    the kernel and the split merge are replaced by recorders): every argument bound once, in order, strides on
    their own names, the split plan and tree flag passed through, the merge launched after it."""
    from longspec_ops.kernels import attention_sm90 as SM

    fn = SM._split_attn_sm90_kernel
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(SM, "_split_attn_sm90_kernel", Recorder())
    monkeypatch.setattr(K, "_merge_splits_kernel", Recorder())
    monkeypatch.setattr(K, "_wgmma_applies", lambda *args: True)
    B, M, N, Hq, Hkv, D = 2, 5, 256, 8, 2, 64
    q = torch.zeros(B, Hq, M, D, dtype=torch.float16).transpose(1, 2)  # head-major storage
    k = v = torch.zeros(B, N, Hkv, D, dtype=torch.float16)
    kt = torch.zeros(B, Hkv, M, D, dtype=torch.float16).transpose(1, 2)
    vt = torch.zeros(B, M, Hkv, D, dtype=torch.float16)
    mask = torch.ones(B, M, M, dtype=torch.bool)
    lens = torch.full((B,), N, dtype=torch.int32)
    cfg = dataclasses.replace(C._SM90_SPLIT, split_rows=64)
    K.hybrid_tree_attn(q, k, v, lens, kt, vt, mask, 0.125, config=cfg)
    (grid, args, kwargs), (_, merge_args, _) = calls
    assert merge_args[0] is args[fn.arg_names.index("WS_O")]
    constexprs = {"D", "G", "BLOCK_N", "STAGES", "HAS_TREE"}
    assert len(args) == len(fn.arg_names) - len(constexprs) and set(kwargs) == constexprs | {"num_warps"}
    bound = dict(zip(fn.arg_names, args), **kwargs)
    assert bound["Q"] is q and bound["LENS"] is lens and bound["KT"] is kt and bound["VT"] is vt
    assert (bound["stride_qb"], bound["stride_qm"], bound["stride_qh"]) == q.stride()[:3]
    assert (bound["stride_ktb"], bound["stride_ktm"], bound["stride_kth"]) == kt.stride()[:3]
    assert (bound["stride_vtb"], bound["stride_vtm"], bound["stride_vth"]) == vt.stride()[:3]
    assert (bound["stride_tb"], bound["stride_tm"], bound["stride_tn"], bound["stride_lb"]) == (M * M, M, 1, 1)
    assert (bound["M"], bound["N"], bound["HKV"], bound["R"]) == (M, N, Hkv, M * Hq // Hkv)
    assert (bound["split_rows"], bound["num_splits"]) == (64, 4) and bound["WS_O"].shape == (B * Hkv, 4, 20, D)
    assert abs(bound["qk_scale"] - 0.125 * 1.4426950408889634) < 1e-9
    assert kwargs["HAS_TREE"] is True and kwargs["D"] == D and kwargs["G"] == Hq // Hkv
    assert grid == (1, 4, B * Hkv)
