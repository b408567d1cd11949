"""Sweep the split-KV kernel's launch configs on the GPU at Llama-3-8B shapes (Hq 32, Hkv 8, D 128, bf16, B 1).

Prints, per (case, N), the fastest configs by CUDA-graph replay time with a cold L2, and where the table default
ranks. ``--flush`` compares the timer's read flush of the L2 with a memset flush; ``--eager`` measures the eager
per-call host cost by part; ``--paths`` compares the Gluon wgmma kernel with the Triton kernel and toggles the
Triton kernel's TMA cache loads and the PDL merge launch. Usage (GPU):

    python -m benchmarks.sweep_attention [--quick] [--cases tree-32768,...] [--flush] [--eager] [--paths] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os

import torch
import triton

from benchmarks.harness import write_results
from benchmarks.test_attention import Case
from benchmarks.timing import Timer
from longspec_ops.kernels import configs as C
from longspec_ops.kernels import launch as K


def _configs(case: str, N: int, quick: bool):
    # Forced split counts around the rule's choice (None): the rule trades waves of programs against merge work.
    splits = [None] + [-(-N // s) for s in ((4, 5, 6, 8, 16) if case == "tree" else (8, 16, 32, 64))]
    if case == "tree":
        grid = itertools.product([128], [64], [8], [3, 4], splits)
        if not quick:
            grid = itertools.chain(grid, itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4], [None]))
        if torch.cuda.get_device_capability() == (9, 0):  # the Gluon wgmma kernel: ring depth, split count
            sm90 = C.split_config(128, 296, torch.bfloat16, torch.device("cuda"))
            for st, sr in itertools.product([3] if quick else [2, 3, 4], splits + [-(-N // 13), -(-N // 26)]):
                yield dataclasses.replace(sm90, num_stages=st, split_rows=sr)
    else:
        grid = itertools.product([16], [64, 128], [4], [3, 4] if quick else [2, 3, 4], splits)
    for bm, bn, w, st, sr in grid:
        yield C.AttnConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, split_rows=sr)


def sweep(case: str, N: int, timer: Timer, quick: bool) -> list[dict]:
    M = 74 if case == "tree" else 1
    c = Case(N, M)
    rows = []
    for cfg in [None, *_configs(case, N, quick)]:
        if case == "tree":
            fn = lambda cfg=cfg: K.hybrid_tree_attn(c.q, c.k, c.v, c.seqlens, c.k_tree, c.v_tree, c.mask, c.scale,
                                                    config=cfg)
        else:
            fn = lambda cfg=cfg: K.prefix_attn(c.q, c.k, c.v, c.seqlens, c.scale, config=cfg)
        try:
            us = timer.graph_us(fn)
        except Exception as e:  # a config Triton cannot compile for this shape (shared memory, registers)
            rows.append({"config": repr(cfg), "error": str(e)[:120]})
            continue
        rows.append({"config": repr(cfg) if cfg else "table default", "us": us})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    print(f"\n== {case} N={N}: best of {len(ok)}")
    for r in ok[:6]:
        print(f"  {r['us']:8.1f} us  {r['config']}")
    default = next(r for r in rows if r["config"] == "table default")
    print(f"  default {default.get('us', float('nan')):.1f} us (rank {ok.index(default) + 1 if default in ok else '-'})")
    return rows


class _MemsetFlushTimer(Timer):
    """Triton's ``do_bench`` flush: a 256 MB memset, leaving dirty lines for the timed kernel to write back."""

    def flush_l2(self) -> None:
        self._flush.zero_()


def flush_check(timer: Timer) -> list[dict]:
    """Graph-replay time with the L2 flushed by a 256 MB read (the Timer's default) against a 256 MB memset."""
    from benchmarks.test_attention import longspec_decode, longspec_hybrid, sdpa_decode, torch_fa2_merge

    memset = _MemsetFlushTimer(reps=timer.reps, warmup=timer.warmup)
    rows = []
    for N in (8192, 32768, 131072):
        for name, build, M in (("longspec hybrid_tree_attn", longspec_hybrid, 74),
                               ("PyTorch FA2 + merge", torch_fa2_merge, 74),
                               ("longspec prefix_attn (M=1)", longspec_decode, 1),
                               ("SDPA decode (M=1)", sdpa_decode, 1)):
            fn = build(Case(N, M))
            row = {"method": name, "N": N, "read flush us": timer.graph_us(fn), "memset flush us": memset.graph_us(fn)}
            rows.append(row)
            print(row, flush=True)
    return rows


def load_paths(timer: Timer) -> list[dict]:
    """Kernel and launch paths against the default: for tree verification the Gluon wgmma kernel (sm_90) against
    the Triton kernel's table config; for the Triton kernel its cache loads (TMA descriptors or pointers) and the
    merge launch (PDL or plain)."""
    rows = []
    for N in (8192, 32768, 131072):
        for case, M in (("hybrid_tree_attn (M=74)", 74), ("prefix_attn (M=1)", 1)):
            c = Case(N, M)
            rows_g = M * (c.q.shape[2] // c.k.shape[2])
            default = C.split_config(c.q.shape[3], rows_g, c.q.dtype, c.q.device)
            triton_cfg = C.split_config(c.q.shape[3], rows_g, c.q.dtype)  # the Triton kernel's table config
            variants = {"default": default}
            if default.wgmma:
                variants["Gluon wgmma, plain merge launch"] = dataclasses.replace(default, pdl=False)
                variants["Triton kernel, table config"] = triton_cfg
            for label, tma, pdl in (("pointers + PDL", False, True), ("TMA, plain launch", True, False),
                                    ("pointers, plain launch", False, False)):
                variants[f"Triton kernel, {label}"] = dataclasses.replace(triton_cfg, tma=tma, pdl=pdl)
            for label, cfg in variants.items():
                if M > 1:
                    fn = lambda cfg=cfg: K.hybrid_tree_attn(c.q, c.k, c.v, c.seqlens, c.k_tree, c.v_tree, c.mask,
                                                            c.scale, config=cfg)
                else:
                    fn = lambda cfg=cfg: K.prefix_attn(c.q, c.k, c.v, c.seqlens, c.scale, config=cfg)
                row = {"op": case, "N": N, "path": label, "us": timer.graph_us(fn)}
                rows.append(row)
                print(row, flush=True)
    return rows


def eager_overhead() -> list[dict]:
    """Host microseconds per eager call, by part (N small, so the GPU only ever waits for the host)."""
    import time

    from benchmarks.test_attention import longspec_hybrid, sdpa_decode
    from longspec_ops import _checks

    @triton.jit
    def _one_arg(X):
        pass

    def per_call(fn, n=400) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    from triton.tools.tensor_descriptor import TensorDescriptor

    def pointers(case):  # the table config with pointer cache loads instead of TMA
        base = C.split_config(case.q.shape[3], case.q.shape[1] * (case.q.shape[2] // case.k.shape[2]), case.q.dtype)
        return dataclasses.replace(base, tma=False)

    block = [1, 64, 1, 128]
    x = torch.empty(16, device="cuda")
    c, c1 = Case(1024, 74), Case(64, 1)  # c1: a 64-row cache is one split, so prefix_attn is one launch
    parts = {
        "torch.empty (one tensor)": lambda: torch.empty((1, 74, 32, 128), dtype=torch.bfloat16, device="cuda"),
        "Triton launch, 1-argument empty kernel": lambda: _one_arg[(1,)](x),
        "argument checks (check_hybrid)": lambda: _checks.check_hybrid(c.q, c.k, c.v, c.seqlens, c.k_tree, c.v_tree,
                                                                       c.mask, c.scale),
        "kernels.prefix_attn, 1 launch": lambda: K.prefix_attn(c1.q, c1.k, c1.v, c1.seqlens, c1.scale),
        "torch.ops.longspec.prefix_attn, 1 launch": lambda: torch.ops.longspec.prefix_attn(c1.q, c1.k, c1.v,
                                                                                          c1.seqlens, c1.scale),
        "kernels.hybrid_tree_attn, 2 launches": lambda: K.hybrid_tree_attn(c.q, c.k, c.v, c.seqlens, c.k_tree,
                                                                           c.v_tree, c.mask, c.scale),
        "torch.ops.longspec.hybrid_tree_attn, 2 launches": longspec_hybrid(c),
        "kernels.prefix_attn, 1 launch, pointer loads": lambda: K.prefix_attn(
            c1.q, c1.k, c1.v, c1.seqlens, c1.scale, config=pointers(c1)),
        "kernels.hybrid_tree_attn, 2 launches, pointer loads": lambda: K.hybrid_tree_attn(
            c.q, c.k, c.v, c.seqlens, c.k_tree, c.v_tree, c.mask, c.scale, config=pointers(c)),
        "two TensorDescriptor objects": lambda: (TensorDescriptor(c.k, list(c.k.shape), list(c.k.stride()), block),
                                                 TensorDescriptor(c.v, list(c.v.shape), list(c.v.stride()), block)),
        "SDPA decode (C++ dispatch, for scale)": sdpa_decode(Case(1024, 1)),
    }
    rows = [{"what": name, "host us per call": per_call(fn)} for name, fn in parts.items()]
    for r in rows:
        print(r, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    ap.add_argument("--cases", default="tree-32768,decode-32768,tree-131072,decode-131072,tree-8192",
                    help="comma-separated <tree|decode>-<N>; empty: no config sweep")
    ap.add_argument("--flush", action="store_true", help="also compare read and memset L2 flushes")
    ap.add_argument("--eager", action="store_true", help="also measure eager host overhead by part")
    ap.add_argument("--paths", action="store_true",
                    help="also compare the Gluon and Triton kernels, TMA/pointer loads and PDL/plain merge launch")
    args = ap.parse_args()
    timer = Timer(reps=30, warmup=3)
    results = {}
    for spec in filter(None, args.cases.split(",")):
        case, N = spec.split("-")
        results[spec] = sweep(case, int(N), timer, args.quick)
    if results:
        rows = [{"case": spec, **r} for spec, rs in results.items() for r in rs]
        write_results("sweep", rows, args.out, title="Split-KV launch configs",
                      notes=["CUDA-graph replay, cold L2, median of 30, Llama-3-8B attention shapes. `python -m "
                             "benchmarks.sweep_attention --cases ...`"])
    for flag, name, fn, title, note in (
        (args.flush, "flush", lambda: flush_check(timer), "L2 flush: read vs memset",
         "CUDA-graph replay, Llama-3-8B attention shapes, median of 30. `python -m "
         "benchmarks.sweep_attention --cases '' --flush`"),
        (args.paths, "paths", lambda: load_paths(Timer(reps=100, warmup=3)), "Kernels, cache loads and merge launch",
         "CUDA-graph replay, cold L2, median of 100, Llama-3-8B attention shapes, default configs. `python -m "
         "benchmarks.sweep_attention --cases '' --paths`"),
        (args.eager, "eager", eager_overhead, "Eager host overhead per call",
         "Host time per call, 400 calls, small N so the GPU waits on the host. `python -m "
         "benchmarks.sweep_attention --cases '' --eager`"),
    ):
        if flag:
            write_results(name, fn(), args.out, title=title, notes=[note])


if __name__ == "__main__":
    main()
