"""Can a Triton kernel read a draft level's weights faster than cuBLAS does at M <= 16 rows? (issue 32)

At Llama-3-8B shapes a draft level's three 4096 x 4096 projections (32 MB each) ran at 1.9x their byte floor in
the draft profile (``results/h200/draft_profile.txt``): cuBLAS picks split-K for so few rows and adds a reduce
kernel. This probe times ``torch.mm`` against the package's ``longspec::fused_linear`` kernel
(:mod:`longspec_ops.kernels.linear`: each program owns ``block_n`` output columns and streams their weight rows
once, all M rows at a time, fp32 accumulation, no split of K and so no second kernel) over a grid of launch
configurations and with its default table, at the draft's linear shapes (M = 1, 4, 16 frontier rows). Each timed
call reads a different copy of the weight, so the weight comes from HBM as in a real step (not from L2, which holds
32 MB). Then the fusions: the kernel with its RMSNorm / SwiGLU / residual folded in against the same work as
separate launches (``longspec::rms_norm``, cuBLAS, PyTorch's elementwise kernels). Output: every row's times and
both against the byte floor (weight + activations at the measured copy bandwidth).

``--fp8``: instead, float8_e4m3fn weights with per-row scales (``fused_linear``'s ``weight_scale``) against the
16-bit table launch and cuBLAS at the same shapes, over a grid of launches (the float8 rule in
:func:`~longspec_ops.kernels.linear.default_config` is the table's ``fp8_table`` column), and the table launch with
more warps and K split over 2 or 4 programs (``--no-grid``: without the grid; ``--shapes 32B --rows 16``: only
Qwen2.5-32B's draft shapes at 16 rows, written to ``probe_skinny_gemm_fp8_32B.json``).

Usage (GPU): ``python -m benchmarks.probe_skinny_gemm [--fusions-only | --fp8] [--out DIR]``. The kernel's values are
tested in ``tests/ops/test_fused_linear.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton

from longspec_ops.kernels.linear import LinearConfig, default_config, fused_linear

# (name, N, K): out x in features of the draft block's linears as it runs them (q/k/v and gate/up packed,
# ``longspec/model/packing.py``): at Llama-3-8B (hidden 4096, MLP 14336, 8 KV heads of 128) with its reduced 32k-token
# LM head, and at the shipped pair (hidden 384, MLP 1024, 2 KV heads of 64, 2k drafting vocabulary), whose step is
# launch-bound: there the question is the fixed cost of a launch, not bandwidth.
SHAPES = [("8B q/k/v", 6144, 4096), ("8B o/cross q/cross o", 4096, 4096), ("8B gate/up", 28672, 4096),
          ("8B down", 4096, 14336), ("8B lm head 32k", 32768, 4096),
          ("pair q/k/v", 640, 384), ("pair o", 384, 384), ("pair gate/up", 2048, 384), ("pair down", 384, 1024),
          ("pair lm head 2k", 2048, 384)]
ROWS = (1, 4, 16)
CONFIGS = [LinearConfig(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5))]


def _rotating(fn_of, copies):
    """A callable that runs ``fn_of(copy)`` on the next copy each call (each captured call gets its own)."""
    it = itertools.cycle(copies)
    return lambda: fn_of(next(it))


def probe(out_dir: str | None, sweep: bool = True) -> list[dict]:
    from benchmarks.harness import environment
    from benchmarks.timing import graph_calls_us, measure_peaks

    dev, dt = "cuda", torch.bfloat16
    bw = measure_peaks(dev)["copy_bytes_per_s"]
    rows = []
    for (name, N, K), M in itertools.product(SHAPES if sweep else [], ROWS):
        copies = min(24, max(3, -(-(256 << 20) // (N * K * 2))))  # >= 256 MB in rotation: no L2 reuse
        ws = [torch.randn(N, K, device=dev, dtype=dt) for _ in range(copies)]
        x = torch.randn(M, K, device=dev, dtype=dt)
        out = torch.empty(M, N, device=dev, dtype=dt)
        ref = F.linear(x, ws[0])
        floor_us = (N * K + M * K + M * N) * 2 / bw * 1e6
        cublas = graph_calls_us(_rotating(lambda w: torch.mm(x, w.t(), out=out), ws), calls=32)
        best = None
        for cfg in CONFIGS:
            try:
                got = fused_linear(x, ws[0], None, None, 0.0, None, False, config=cfg)
                if not torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2):
                    raise AssertionError(f"wrong result with {cfg}")
                us = graph_calls_us(_rotating(lambda w, c=cfg: fused_linear(x, w, None, None, 0.0, None, False,
                                                                            config=c), ws), calls=32)
            except triton.runtime.errors.OutOfResources:  # a config too big for shared memory
                continue
            if best is None or us < best[0]:
                best = (us, cfg)
        table = default_config(N, K, torch.cuda.get_device_properties(0).multi_processor_count)  # as the op runs
        table_us = graph_calls_us(_rotating(lambda w: fused_linear(x, w, None, None, 0.0, None, False,
                                                                   config=table), ws), calls=32)
        row = {"shape": name, "M": M, "N": N, "K": K, "floor_us": floor_us, "cublas_us": cublas,
               "cublas_vs_floor": cublas / floor_us, "triton_us": best[0], "triton_vs_floor": best[0] / floor_us,
               "triton_config": dataclasses.asdict(best[1]), "table_us": table_us,
               "table_config": dataclasses.asdict(table)}
        rows.append(row)
        print(f"{name:12s} M={M:2d} N={N:5d} K={K:5d}: floor {floor_us:6.1f} us, cuBLAS {cublas:6.1f} "
              f"({cublas / floor_us:.2f}x), Triton {best[0]:6.1f} ({best[0] / floor_us:.2f}x) {best[1]}, "
              f"table {table_us:6.1f}", flush=True)
        del ws
        torch.cuda.empty_cache()
    fusions = probe_fusions(bw)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "probe_skinny_gemm.json"), "w") as f:
            json.dump({"environment": environment(), "copy_bytes_per_s": bw, "rows": rows, "fusions": fusions}, f,
                      indent=1)
    return rows


# (name, N, K, swiglu): the fused launches of a draft level, at 16 rows
FUSED = [("8B N1 + q/k/v", 6144, 4096, False), ("8B N3 + gate/up + SwiGLU", 28672, 4096, True),
         ("8B o_proj + residual", 4096, 4096, False), ("pair N1 + q/k/v", 640, 384, False),
         ("pair N3 + gate/up + SwiGLU", 2048, 384, True), ("pair o_proj + residual", 384, 384, False)]


def probe_fusions(bw: float, M: int = 16) -> list[dict]:
    """Each fused launch against its separate launches (norm kernel + cuBLAS + elementwise), weights rotated."""
    from benchmarks.timing import graph_calls_us

    from longspec_ops.kernels.linear import composed_linear

    dev, dt = "cuda", torch.bfloat16
    rows = []
    for name, N, K, swiglu in FUSED:
        residual_case = "residual" in name
        copies = min(24, max(3, -(-(256 << 20) // (N * K * 2))))
        ws = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(copies)]
        x = torch.randn(M, K, device=dev, dtype=dt)
        g = None if residual_case else torch.ones(K, device=dev, dtype=dt)
        res = torch.randn(M, N, device=dev, dtype=dt) if residual_case else None
        fused = graph_calls_us(_rotating(lambda w: torch.ops.longspec.fused_linear(x, w, None, g, 1e-6, res, swiglu),
                                         ws), calls=32)
        composed = graph_calls_us(_rotating(lambda w: composed_linear(x, w, None, g, 1e-6, res, swiglu), ws),
                                  calls=32)
        floor_us = (N * K + M * K + M * N) * 2 / bw * 1e6
        rows.append({"launch": name, "M": M, "N": N, "K": K, "floor_us": floor_us, "fused_us": fused,
                     "separate_us": composed})
        print(f"{name:28s} M={M}: floor {floor_us:6.1f} us, fused {fused:6.1f}, separate launches {composed:6.1f}",
              flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


FP8_CONFIGS = [LinearConfig(n, k, 4, st) for n, k, st in itertools.product((32, 64), (128, 256, 512), (3, 4, 5))]
# (num_warps, split_k) around the table launch
FP8_VARIANTS = [(4, 1), (8, 1), (4, 2), (4, 4)]
FP8_SHAPES = SHAPES + [("8B gate/up + SwiGLU", 28672, 4096), ("pair gate/up + SwiGLU", 2048, 384),
                       # Qwen2.5-32B's draft block (hidden 5120, MLP 27648, 8 KV heads of 128), 32k-token head
                       ("32B q/k/v", 7168, 5120), ("32B o/cross q/cross o", 5120, 5120),
                       ("32B gate/up + SwiGLU", 55296, 5120), ("32B down", 5120, 27648),
                       ("32B lm head 32k", 32768, 5120)]
FP8_SPLITS = (1, 2, 4)  # K split over programs in the grid, from K = 8192 (down_proj)


def probe_fp8(out_dir: str | None, grid: bool = True, prefixes: tuple[str, ...] = (), rows_m=(1, 16)) -> list[dict]:
    """Float8 weights against 16-bit ones: cuBLAS and the 16-bit table launch, the float8 table launch and the
    best float8 launch of a grid (K split too from K = 8192), at ``rows_m`` rows, weights rotated through >= 256 MB
    of copies; ``prefixes``: only the shapes whose names start with one of them (e.g. "32B")."""
    from benchmarks.harness import environment
    from benchmarks.timing import graph_calls_us, measure_peaks

    from longspec_ops.reference.linear import quantize_fp8_rows

    dev, dt = "cuda", torch.bfloat16
    bw = measure_peaks(dev)["copy_bytes_per_s"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    shapes = [s for s in FP8_SHAPES if not prefixes or s[0].startswith(tuple(prefixes))]
    for (name, N, K), M in itertools.product(shapes, rows_m):
        swiglu = "SwiGLU" in name
        n_out = N // 2 if swiglu else N
        copies = min(24, max(3, -(-(256 << 20) // (N * K))))
        ws = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(copies)]
        q8 = [quantize_fp8_rows(w) for w in ws]
        x = torch.randn(M, K, device=dev, dtype=dt)

        def run16(w, c=None):
            return fused_linear(x, w, None, None, 0.0, None, swiglu, config=c)

        def run8(wq, c=None):
            return fused_linear(x, wq[0], None, None, 0.0, None, swiglu, weight_scale=wq[1], config=c)

        ref = run16(ws[0]).float()
        bf16 = graph_calls_us(_rotating(run16, ws), calls=32)
        table16 = default_config(n_out, K, sms, swiglu)
        split16 = {k: graph_calls_us(_rotating(lambda w, c=dataclasses.replace(table16, split_k=k): run16(w, c), ws),
                                     calls=32) for k in (2, 4)} if K >= 2048 else {}
        cublas = None if swiglu else graph_calls_us(_rotating(lambda w: torch.mm(x, w.t()), ws), calls=32)
        table = default_config(n_out, K, sms, swiglu, weight_bytes=1)
        fp8_table = graph_calls_us(_rotating(lambda wq: run8(wq, table), q8), calls=32)
        # the table launch with more warps or K split over programs (LinearConfig.num_warps, split_k)
        variants = {}
        for warps, split in FP8_VARIANTS:
            cfg = dataclasses.replace(table, num_warps=warps, split_k=split)
            variants[warps, split] = graph_calls_us(_rotating(lambda wq, c=cfg: run8(wq, c), q8), calls=32)
        best = None
        grid_cfgs = [dataclasses.replace(c, split_k=k) for c in FP8_CONFIGS
                     for k in (FP8_SPLITS if K >= 8192 and not swiglu else (1,))]
        for cfg in grid_cfgs if K >= 2048 and grid else []:
            try:
                got = run8(q8[0], cfg).float()
                if not torch.allclose(got, ref, rtol=0.15, atol=0.15 * ref.abs().max().item()):
                    raise AssertionError(f"fp8 result far from the 16-bit one with {cfg}")
                us = graph_calls_us(_rotating(lambda wq, c=cfg: run8(wq, c), q8), calls=32)
            except triton.runtime.errors.OutOfResources:
                continue
            if best is None or us < best[0]:
                best = (us, cfg)
        floor16 = (N * K * 2 + M * K * 2 + M * n_out * 2) / bw * 1e6
        floor8 = (N * K + N * 4 + M * K * 2 + M * n_out * 2) / bw * 1e6
        row = {"shape": name, "M": M, "N": N, "K": K, "floor16_us": floor16, "floor8_us": floor8,
               "cublas_us": cublas, "bf16_table_us": bf16, "fp8_table_us": fp8_table,
               "fp8_table_config": dataclasses.asdict(table),
               **{f"fp8_w{w}_split{k}_us": us for (w, k), us in variants.items()},
               **{f"bf16_split{k}_us": us for k, us in split16.items()},
               "fp8_best_us": best[0] if best else None,
               "fp8_best_config": dataclasses.asdict(best[1]) if best else None}
        rows.append(row)
        shown = " ".join(f"{w}/{k} {us:.1f}" for (w, k), us in variants.items())
        print(f"{name:22s} M={M:2d}: 16-bit floor {floor16:6.1f} us, table {bf16:6.1f}"
              f"{'' if cublas is None else f', cuBLAS {cublas:6.1f}'} | fp8 floor {floor8:6.1f}, table {fp8_table:6.1f}"
              f" (warps/split {shown}; 16-bit split 2 / 4 {split16.get(2, 0):.1f} / {split16.get(4, 0):.1f})"
              f"{'' if best is None else f', best {best[0]:6.1f} {best[1]}'}", flush=True)
        del ws, q8
        torch.cuda.empty_cache()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        fname = "probe_skinny_gemm_fp8" + "".join(f"_{p.replace('/', '')}" for p in prefixes)  # a subset: its own file
        with open(os.path.join(out_dir, f"{fname}.json"), "w") as f:
            json.dump({"environment": environment(), "copy_bytes_per_s": bw, "rows": rows}, f, indent=1)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fusions-only", action="store_true", help="skip the configuration sweep")
    mode.add_argument("--fp8", action="store_true", help="float8 weights against 16-bit ones (probe_skinny_gemm_fp8)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-grid", action="store_true", help="--fp8: the table launches only (no grid of launches)")
    ap.add_argument("--shapes", nargs="+", default=[], metavar="PREFIX",
                    help="--fp8: only the shapes whose names start with these (e.g. 32B)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16], help="--fp8: rows of x (M) to time")
    a = ap.parse_args()
    if a.fp8:
        probe_fp8(a.out, grid=not a.no_grid, prefixes=tuple(a.shapes), rows_m=tuple(a.rows))
    else:
        probe(a.out, sweep=not a.fusions_only)


if __name__ == "__main__":
    main()
