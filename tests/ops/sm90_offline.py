"""Compiles the Gluon sm_90 split-KV kernel offline for sm_90a and reports what its speed rests on, as JSON:
registers, spills, shared memory, and how many exponentials each key block issues while the previous block's
P @ V wgmma is in flight. Run in a process without ``TRITON_INTERPRET`` (under the interpreter, ``gluon.jit``
builds interpreted functions that cannot be compiled): ``python -m tests.ops.sm90_offline D {bf16|fp16}``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

from longspec_ops.kernels import configs as C
from longspec_ops.kernels import attention_sm90 as SM

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(D: int, dtype: torch.dtype, cfg: C.AttnConfig):
    """The kernel as ``_launch_sm90`` specialises it, compiled for sm_90a (no device needed)."""
    fn = SM._split_attn_sm90_kernel
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    block = [1, cfg.block_n, 1, D]
    desc = TensorDescriptor.from_tensor(torch.zeros(1, 256, 8, D, dtype=dtype), block,
                                        gl.NVMMASharedLayout.get_default_for(block, gdt))
    elt = "bf16" if dtype == torch.bfloat16 else "fp16"
    constexprs = dict(D=D, G=4, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, HAS_TREE=True)
    pointers = dict(Q=f"*{elt}", KT=f"*{elt}", VT=f"*{elt}", LENS="*i32", TMASK="*u8", WS_O="*fp32", WS_LSE="*fp32")
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("KD", "VD"):
            sig[name] = mangle_type(desc)
        else:
            sig[name] = pointers.get(name, "fp32" if name == "qk_scale" else "i32")
    aligned = [n for n in fn.arg_names
               if sig[n].startswith("*") or n.startswith(("stride_q", "stride_kt", "stride_vt"))]
    src = GluonASTSource(fn=fn, signature=sig,
                         constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                         attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps))


def _cuobjdump(kernel, *args: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([os.path.join(_BIN, "cuobjdump"), *args, path], capture_output=True, text=True,
                              check=True).stdout


def report(D: int, dtype: torch.dtype) -> dict:
    cfg = C._SM90_SPLIT
    kernel = compile_sm90(D, dtype, cfg)
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", _cuobjdump(kernel, "--dump-resource-usage"))
    sass = _cuobjdump(kernel, "-sass")
    # Exponentials between "at most one wgmma group in flight" (S_j done, P_{j-1} V_{j-1} running) and "none".
    segments = re.findall(r"DEPBAR\.LE gsb0, 0x1(.*?)DEPBAR\.LE gsb0, 0x0", sass, flags=re.S)
    overlapped = [seg.count("MUFU.EX2") for seg in segments]
    # Warp shuffles in those softmax regions: the row max needs 2 per row (the 4 lanes of a quad); the row sums
    # stay per lane until after the last block, so they add none.
    shuffles = [seg.count("SHFL.") for seg in segments]
    return dict(regs=int(usage.group(1)), stack=int(usage.group(2)), local=int(usage.group(4)),
                shared=kernel.metadata.shared, threads=32 * cfg.num_warps, occupancy=cfg.occupancy,
                block_n=cfg.block_n, overlapped_exps=overlapped, overlapped_shuffles=shuffles,
                triton=triton.__version__)


if __name__ == "__main__":
    print(json.dumps(report(int(sys.argv[1]), {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[2]])))
