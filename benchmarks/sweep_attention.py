"""Sweep the split-KV kernel's launch configs on the GPU at Llama-3-8B shapes (Hq 32, Hkv 8, D 128, bf16, B 1).

Prints, per (case, N), the fastest configs by CUDA-graph replay time with a cold L2, and where the table default
ranks. Also profiles the eager per-call host cost of ``torch.ops.longspec.hybrid_tree_attn``. Usage (GPU):

    python -m benchmarks.sweep_attention [--quick]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats

import torch

from benchmarks.test_attention import Case
from benchmarks.timing import Timer
from longspec_ops.kernels import attention as K


def _configs(case: str, quick: bool):
    if case == "tree":
        grid = itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4], [None] if quick else [None, 4096])
    else:
        grid = itertools.product([16], [64, 128], [4], [2, 3, 4], [None, 256, 512, 1024, 2048])
    for bm, bn, w, st, sr in grid:
        if case == "decode" and quick and st == 2:
            continue
        yield K.AttnConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, split_rows=sr)


def sweep(case: str, N: int, timer: Timer, quick: bool) -> list[dict]:
    M = 74 if case == "tree" else 1
    c = Case(N, M)
    rows = []
    for cfg in [None, *_configs(case, quick)]:
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


def eager_profile() -> str:
    c = Case(32768, 74)
    op = torch.ops.longspec.hybrid_tree_attn
    args = (c.q, c.k, c.v, c.seqlens, c.k_tree, c.v_tree, c.mask, c.scale)
    for _ in range(5):
        op(*args)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        op(*args)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="tree-32768,decode-32768,tree-131072,decode-131072,tree-8192")
    args = ap.parse_args()
    timer = Timer(reps=30, warmup=3)
    results = {}
    for spec in args.cases.split(","):
        case, N = spec.split("-")
        results[spec] = sweep(case, int(N), timer, args.quick)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(results, f, indent=1)
    prof = eager_profile()
    print(prof)
    with open(os.path.join(args.out, "eager_profile.txt"), "w") as f:
        f.write(prof)


if __name__ == "__main__":
    main()
