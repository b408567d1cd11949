"""The draft level's attention calls (self-attention over the window + tree keys, cross-attention into the target's
cache) under the default split plan and forced split sizes, one CUDA graph of 50 calls each, at the shipped pair's
and published shapes. Usage (GPU): ``python -m benchmarks.probe_draft_attn pair Llama-3-8B``."""

import dataclasses
import sys

import torch

from benchmarks.timing import graph_calls_us
from longspec_ops.kernels import launch as L
from longspec_ops.kernels.configs import split_config


def main():
    from benchmarks.step_parts import target_and_draft

    for name in sys.argv[1:]:
        target, draft = target_and_draft(name)
        c = draft.config
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        dev, dt = "cuda", torch.bfloat16
        print(name, "Hq", Hq, "Hkv", Hkv, "D", D, "window", c.window, flush=True)
        W1 = c.window + 1
        wk = torch.randn(1, W1, Hkv, D, device=dev, dtype=dt)
        wv = torch.randn_like(wk)
        tk = torch.randn(1, 68, Hkv, D, device=dev, dtype=dt)
        tv = torch.randn_like(tk)
        lens = torch.full((1,), W1 - 2, dtype=torch.int32, device=dev)
        for M, hi in ((4, 4), (16, 20), (16, 68)):
            q = torch.randn(1, M, Hq, D, device=dev, dtype=dt)
            mask = torch.ones(1, M, hi, dtype=torch.bool, device=dev)
            base = split_config(D, M * (Hq // Hkv), dt, q.device)
            for label, cfg in (
                ("default", None),
                ("split512", dataclasses.replace(base, split_rows=512)),
                ("direct", dataclasses.replace(base, split_rows=1 << 20)),
                ("split256", dataclasses.replace(base, split_rows=256)),
                ("split128", dataclasses.replace(base, split_rows=128)),
            ):
                us = graph_calls_us(
                    lambda: L.hybrid_tree_attn(q, wk, wv, lens, tk[:, :hi], tv[:, :hi], mask, D**-0.5, config=cfg)
                )
                print(f"  self M={M} keys={hi} {label}: {us:.2f} us", flush=True)
        for N in (8192, 32768):
            k = torch.randn(1, N, Hkv, D, device=dev, dtype=dt)
            v = torch.randn_like(k)
            ln = torch.full((1,), N - 100, dtype=torch.int32, device=dev)
            for M in (1, 4, 12, 16):
                q = torch.randn(1, M, Hq, D, device=dev, dtype=dt)
                base = split_config(D, M * (Hq // Hkv), dt, q.device)
                variants = [("default", None)] + [
                    (f"s{rows}", dataclasses.replace(base, split_rows=rows)) for rows in (512, 1024, 2048, 4096)
                ] + [  # tiles small enough for 2-3 programs an SM (K + V stages of shared memory), the split rule
                    # told so through occupancy
                    (f"bn{bn}st{st}occ{occ}", dataclasses.replace(base, block_n=bn, num_stages=st, occupancy=occ))
                    for bn, st, occ in ((64, 3, 2), (64, 2, 3), (32, 4, 3), (128, 2, 1), (64, 4, 1))
                ]
                for label, cfg in variants:
                    us = graph_calls_us(lambda: L.prefix_attn(q, k, v, ln, D**-0.5, config=cfg))
                    print(f"  cross N={N} M={M} {label}: {us:.2f} us", flush=True)
        del target, draft
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
