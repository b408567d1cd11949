"""Can a Triton kernel read a draft level's weights faster than cuBLAS does at M <= 16 rows? (issue 32)

At Llama-3-8B shapes a draft level's three 4096 x 4096 projections (32 MB each) ran at 1.9x their byte floor in
the draft profile (``results/h200/draft_profile.txt``): cuBLAS picks split-K for so few rows and adds a reduce
kernel. This probe times ``torch.nn.functional.linear`` against one skinny kernel (each program owns ``BLOCK_N``
output columns and streams their weight rows once, all M rows at a time, fp32 accumulation, no split of K and
so no second kernel) over a small grid of launch configurations, at the draft's linear shapes (M = 1, 4, 16
frontier rows). Each timed call reads a different copy of the weight, so the weight comes from HBM as in a real step
(not from L2, which holds 32 MB). Output: every shape's cuBLAS time, the best Triton configuration and time, and
both against the byte floor (weight + activations at the measured copy bandwidth). The kernel is only a probe;
it is not part of the package.

Usage (GPU): ``python -m benchmarks.probe_skinny_gemm [--out DIR]``. On a CPU ``--check`` runs the kernel under the
Triton interpreter against ``F.linear`` (no timing). Written without device time: so far checked on the CPU
interpreter only, never timed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# (name, N, K): out x in features of the draft block's linears at Llama-3-8B (hidden 4096, MLP 14336, 8 KV heads of
# 128) and its reduced 32k-token LM head.
SHAPES = [("q/o/cross", 4096, 4096), ("k/v", 1024, 4096), ("gate/up", 14336, 4096), ("down", 4096, 14336),
          ("lm head 32k", 32768, 4096)]
ROWS = (1, 4, 16)
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
           for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8), (3, 4, 6))]


@triton.jit
def _skinny_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[:, n-block] = X @ W[n-block, :]^T for all M (<= BLOCK_M) rows of X, K streamed in BLOCK_K steps."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, BLOCK_N: int = 32, BLOCK_K: int = 256,
                  num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``F.linear(x, w)`` for ``x`` [M <= 16, K] and ``w`` [N, K], both contiguous in K, into ``out`` [M, N]."""
    M, K = x.shape
    N = w.shape[0]
    if M > 16 or w.shape[1] != K or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"skinny_linear: needs x [M <= 16, K] and w [N, K] contiguous in K, got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    _skinny_kernel[(triton.cdiv(N, BLOCK_N),)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                               BLOCK_M=16, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps,
                                               num_stages=num_stages)
    return out


def check(device: str = "cpu") -> None:
    """The kernel against ``F.linear`` in float32 (interpreter-safe), ragged N and K included."""
    g = torch.Generator().manual_seed(0)
    for M, N, K in ((1, 48, 96), (4, 100, 300), (16, 64, 256), (7, 33, 130)):
        x = torch.randn(M, K, generator=g).to(device)
        w = torch.randn(N, K, generator=g).to(device)
        out = torch.empty(M, N, device=device)
        got = skinny_linear(x, w, out, BLOCK_N=16, BLOCK_K=64, num_warps=1, num_stages=1)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)
        print(f"check M={M} N={N} K={K}: ok", flush=True)


def _rotating(fn_of, copies):
    """A callable that runs ``fn_of(copy)`` on the next copy each call (each captured call gets its own)."""
    it = itertools.cycle(copies)
    return lambda: fn_of(next(it))


def probe(out_dir: str | None) -> list[dict]:
    from benchmarks.timing import graph_calls_us, measure_peaks

    dev, dt = "cuda", torch.bfloat16
    bw = measure_peaks(dev)["copy_bytes_per_s"]
    rows = []
    for (name, N, K), M in itertools.product(SHAPES, ROWS):
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
                got = skinny_linear(x, ws[0], out, **cfg)
                if not torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2):
                    raise AssertionError(f"wrong result with {cfg}")
                us = graph_calls_us(_rotating(lambda w, c=cfg: skinny_linear(x, w, out, **c), ws), calls=32)
            except triton.runtime.errors.OutOfResources:
                continue
            if best is None or us < best[0]:
                best = (us, cfg)
        row = {"shape": name, "M": M, "N": N, "K": K, "floor_us": floor_us, "cublas_us": cublas,
               "cublas_vs_floor": cublas / floor_us, "triton_us": best[0], "triton_vs_floor": best[0] / floor_us,
               "triton_config": best[1]}
        rows.append(row)
        print(f"{name:12s} M={M:2d} N={N:5d} K={K:5d}: floor {floor_us:6.1f} us, cuBLAS {cublas:6.1f} "
              f"({cublas / floor_us:.2f}x), Triton {best[0]:6.1f} ({best[0] / floor_us:.2f}x) {best[1]}", flush=True)
        del ws
        torch.cuda.empty_cache()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "probe_skinny_gemm.json"), "w") as f:
            json.dump({"copy_bytes_per_s": bw, "rows": rows}, f, indent=1)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only check the kernel's values (CPU interpreter or GPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
    else:
        probe(a.out)


if __name__ == "__main__":
    main()
