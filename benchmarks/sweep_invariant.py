"""Where Numerics.INVARIANT's time goes, and which ``InvariantConfig`` to make the bf16 default (GPU only).

* Linears: every Llama-3-8B projection (q, k/v, o, gate/up, down, the LM head) at M = 1 (decode), 64 and 69 (a
  64-node and the 4-16-16-16-16 verify tree), ``F.linear`` (cuBLAS) against ``invariant_linear`` under the default
  config and a few variants (each M's tile, the N width, the old single tile); then per config the sum over one
  forward (32 layers x (q + k + v + o + gate + up + down) + the LM head). A variant of one tile changes only the
  M it serves (tiles keep the bits, so each M may take the fastest).
* Attention at a 32k cache, Llama-3-8B heads (32 q, 8 kv, D 128): ``invariant_attn`` against
  ``longspec::prefix_attn`` (decode, M = 1) and ``longspec::hybrid_tree_attn`` (the 69-node tree), per layer.

Every time is a CUDA-graph replay with a cold L2 (:class:`benchmarks.timing.Timer`), median of ``--reps``. Writes
``invariant_sweep.{json,md}`` into ``--out``. Usage (GPU, about a minute, most of it Triton compiles):

    PYTHONPATH=$PWD python -m benchmarks.sweep_invariant --out DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F

# Llama-3-8B: (name, K, N, count per layer); the LM head once per forward
HIDDEN, INTER, KV, VOCAB, LAYERS = 4096, 14336, 1024, 128256, 32
LINEARS = [("q_proj", HIDDEN, HIDDEN, 1), ("k/v_proj", HIDDEN, KV, 2), ("o_proj", HIDDEN, HIDDEN, 1),
           ("gate/up_proj", HIDDEN, INTER, 2), ("down_proj", INTER, HIDDEN, 1), ("lm_head", HIDDEN, VOCAB, 0)]
MS = (1, 64, 69)
HQ, HKV, D, CONTEXT = 32, 8, 128, 32768
TREE = (4, 16, 16, 16, 16)  # 69 nodes with the root


def _configs() -> dict[str, object]:
    from longspec_ops.kernels.invariant_launch import LinearTile, invariant_config

    base = invariant_config(torch.bfloat16)
    r = dataclasses.replace
    t16, t64, t128 = base.linear_tiles

    def tiles(*t):
        return r(base, linear_tiles=t)

    return {
        "default": base,
        "one 64-row tile, K step 64 (before)": r(base, linear_tiles=(LinearTile(1 << 62, 64, 64),), linear_k_step=64),
        "16-row tile s4": tiles(r(t16, stages=4), t64, t128),
        "16-row tile K64 s4": tiles(r(t16, block_k=64, stages=4), t64, t128),
        "64-row tile K64": tiles(t16, r(t64, block_k=64), t128),
        "128-row tile s4": tiles(t16, t64, r(t128, stages=4)),
        "128-row tile K128": tiles(t16, t64, r(t128, block_k=128)),
        "N128": r(base, linear_block_n=128),
    }


def _attn_configs() -> dict[str, object]:
    from longspec_ops.kernels.invariant_launch import invariant_config

    base = invariant_config(torch.bfloat16)
    r = dataclasses.replace
    return {
        "default": base,
        "split 1024": r(base, split=1024),
        "split 4096": r(base, split=4096),
        "M128 w8": r(base, attn_block_m=128, attn_warps=8),
        "M128 w8 s4": r(base, attn_block_m=128, attn_warps=8, attn_stages=4),
        "M128 w8 s2": r(base, attn_block_m=128, attn_warps=8, attn_stages=2),
        "merge S8": r(base, merge_block_s=8),
    }


def sweep_linears(timer, configs: dict) -> list[dict]:
    from longspec_ops.kernels.configs import _num_sms
    from longspec_ops.kernels.invariant_launch import invariant_linear, linear_split_k

    sms = _num_sms(torch.device("cuda"))
    g = torch.Generator("cuda").manual_seed(0)
    rows = []
    for name, K, N, _ in LINEARS:
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        gbytes = N * K * 2 / 1e9
        for M in MS:
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
            cublas = timer.graph_us(lambda: F.linear(x, w))
            rows.append({"part": "linear", "shape": f"{name} {K}->{N}", "M": M, "impl": "cuBLAS F.linear",
                         "split_k": "", "us": round(cublas, 1), "weight GB/s": round(gbytes / cublas * 1e6),
                         "x cuBLAS": 1.0})
            for label, cfg in configs.items():
                split = linear_split_k(N, K, cfg, sms)[0]
                try:
                    us = timer.graph_us(lambda cfg=cfg: invariant_linear(x, w, None, config=cfg))
                except Exception as e:  # a config Triton cannot compile (shared memory, registers)
                    rows.append({"part": "linear", "shape": f"{name} {K}->{N}", "M": M, "impl": label,
                                 "split_k": split, "error": str(e)[:120]})
                    continue
                rows.append({"part": "linear", "shape": f"{name} {K}->{N}", "M": M, "impl": label, "split_k": split,
                             "us": round(us, 1), "weight GB/s": round(gbytes / us * 1e6),
                             "x cuBLAS": round(us / cublas, 2)})
            print(*(f"{r['shape']} M={r['M']} {r['impl']}: {r.get('us', r.get('error'))}" for r in rows[-8:]),
                  sep="\n", flush=True)
        del w
    return rows


def forward_sums(rows: list[dict]) -> list[dict]:
    """Per (M, impl): 32 x one layer's linears + the LM head, from the per-shape rows."""
    count = {f"{name} {K}->{N}": (c * LAYERS if c else 1) for name, K, N, c in LINEARS}
    out = []
    for M in MS:
        by_impl: dict[str, float] = {}
        for r in rows:
            if r["M"] == M and "us" in r:
                by_impl[r["impl"]] = by_impl.get(r["impl"], 0.0) + count[r["shape"]] * r["us"]
        complete = {i for i in by_impl if sum(r["M"] == M and r["impl"] == i and "us" in r for r in rows)
                    == len(LINEARS)}
        base = by_impl["cuBLAS F.linear"]
        for impl in sorted(complete, key=by_impl.get):
            out.append({"part": "forward linears (32 layers + LM head)", "shape": "Llama-3-8B", "M": M, "impl": impl,
                        "split_k": "", "us": round(by_impl[impl], 1), "x cuBLAS": round(by_impl[impl] / base, 2)})
    return out


def sweep_attention(timer, configs: dict) -> list[dict]:
    from longspec.model.invariant import tree_ancestors
    from longspec.testing import beam_tree_mask
    from longspec_ops.kernels.invariant_launch import invariant_attn

    g = torch.Generator("cuda").manual_seed(1)
    N, scale = CONTEXT, D ** -0.5
    mask = beam_tree_mask(TREE, 1, torch.Generator().manual_seed(0)).cuda()  # bool [1, 69, 69]
    T = mask.shape[1]
    k = torch.randn(1, N + T, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, N + T, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    seqlens = torch.tensor([N], dtype=torch.int32, device="cuda")
    rows = []
    for M in (1, T):
        q = torch.randn(1, M, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
        if M == 1:
            anc = torch.zeros(1, 1, 1, dtype=torch.int32, device="cuda")
            depths = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
            lens1 = seqlens + 1  # the decoded token's own row
            fast_label = "longspec::prefix_attn"
            fast = lambda q=q, lens1=lens1: torch.ops.longspec.prefix_attn(q, k, v, lens1, scale)
        else:
            anc, depths = tree_ancestors(mask)
            fast_label = "longspec::hybrid_tree_attn"
            fast = lambda q=q: torch.ops.longspec.hybrid_tree_attn(q, k, v, seqlens, k[:, N:], v[:, N:], mask, scale)
        fast_us = timer.graph_us(fast)
        rows.append({"part": "attention per layer", "shape": f"32k, Hq {HQ}, Hkv {HKV}, D {D}", "M": M,
                     "impl": fast_label, "split_k": "", "us": round(fast_us, 1), "x fast": 1.0,
                     "x32 layers us": round(fast_us * LAYERS, 1)})
        for label, cfg in configs.items():
            inv = lambda q=q, anc=anc, depths=depths, cfg=cfg: invariant_attn(q, k, v, seqlens, anc, depths, scale,
                                                                             config=cfg)
            try:
                us = timer.graph_us(inv)
            except Exception as e:  # a config Triton cannot compile (shared memory, registers)
                rows.append({"part": "attention per layer", "shape": f"32k, Hq {HQ}, Hkv {HKV}, D {D}", "M": M,
                             "impl": f"invariant_attn {label}", "error": str(e)[:120]})
                continue
            rows.append({"part": "attention per layer", "shape": f"32k, Hq {HQ}, Hkv {HKV}, D {D}", "M": M,
                         "impl": f"invariant_attn {label}", "split_k": "", "us": round(us, 1),
                         "x fast": round(us / fast_us, 2), "x32 layers us": round(us * LAYERS, 1)})
        print(*(f"attention M={r['M']} {r['impl']}: {r.get('us', r.get('error'))}"
                for r in rows[-1 - len(configs):]), sep="\n", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--no-linears", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.sweep_invariant needs a CUDA GPU (it times Triton kernels against cuBLAS); "
                 "on CPU run the tests instead: pytest tests/ops/test_invariant_kernels.py")
    import longspec_ops  # noqa: F401  (registers the longspec ops)
    from benchmarks.harness import write_results
    from benchmarks.timing import Timer

    t0 = time.perf_counter()
    timer = Timer(reps=args.reps, warmup=3)
    configs, attn_configs = _configs(), _attn_configs()  # both built first: a bad config fails before any timing
    attn = [] if args.no_attention else sweep_attention(timer, attn_configs)
    rows = [] if args.no_linears else sweep_linears(timer, configs)
    sums = forward_sums(rows) if rows else []
    print("\n== forward linears (32 layers + LM head)")
    for r in sums:
        print(f"  M={r['M']:3d} {r['us']:9.1f} us  x{r['x cuBLAS']:.2f}  {r['impl']}")
    meta = {"configs": {k: repr(v) for k, v in configs.items()},
            "attention configs": {k: repr(v) for k, v in attn_configs.items()}, "seconds": round(time.perf_counter() - t0)}
    write_results("invariant_sweep", sums + attn + rows, args.out, title="Numerics.INVARIANT: linears and attention",
                  meta=meta,
                  notes=["bf16, Llama-3-8B shapes, CUDA-graph replay with a cold L2, median of "
                         f"{args.reps}. `python -m benchmarks.sweep_invariant`. split_k: the count the config's rule "
                         "gives that shape on this GPU. Forward sums count q, o, down once, k/v and gate/up twice "
                         "per layer, x32 layers, + the LM head once."])
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
