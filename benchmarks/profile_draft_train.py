"""Where a draft-training step's time goes: the shipped pair's draft trained for a few steps under the PyTorch
profiler, exactly as the recipe trains it (``longspec.train.train``, bf16 autocast, KL term, anchor-offset, flash
noisy), on training text (the recipe's draft sample).

Usage (GPU): ``python -m benchmarks.profile_draft_train --data TRAIN_JSONL [--seq-len 32768] [--loss-chunk 8192]
[--steps 14]``. Prints the step times, the CUDA kernel time per profiled step and the busiest kernels; writes
``draft_train_profile.txt`` under ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from longspec.model.draft import LongSpecDraft
from longspec.pretrained import pair_path
from longspec.train.data import DataConfig
from longspec.train.trainer import TrainConfig


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="training jsonl (e.g. the recipe's corpus/train.jsonl)")
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--loss-chunk", type=int, default=8192, help="tokens per LM-head loss chunk (the deep recipe's)")
    ap.add_argument("--steps", type=int, default=14, help="the last half is profiled")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_draft_train needs a GPU (it profiles CUDA kernels)")
    target = AutoModelForCausalLM.from_pretrained(pair_path("target"), dtype=torch.float32).cuda()
    tokenizer = AutoTokenizer.from_pretrained(pair_path("target"))
    draft = LongSpecDraft.from_pretrained(pair_path("draft"), target=target, dtype=torch.float32)
    active = a.steps // 2
    sched = schedule(wait=a.steps - active - 1, warmup=1, active=active)
    with tempfile.TemporaryDirectory() as out, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                                       schedule=sched) as prof:
        cfg = TrainConfig(data=DataConfig(paths=[a.data], seq_len=a.seq_len), out_dir=out, steps=a.steps,
                          batch_size=a.batch_size, lr=1e-3, kl_weight=1.0, loss_chunk=a.loss_chunk, save_every=10**9,
                          log_every=1, progress=False)
        import longspec.train.trainer as trainer

        real_step = torch.optim.AdamW.step

        def step_and_tick(self, *args, **kwargs):  # one profiler tick per optimizer step
            out_ = real_step(self, *args, **kwargs)
            prof.step()
            return out_

        torch.optim.AdamW.step = step_and_tick
        try:
            hist = trainer.train(cfg, target, tokenizer, draft=draft)
        finally:
            torch.optim.AdamW.step = real_step
    times = [a.batch_size * a.seq_len / h["tokens_per_s"] for h in hist]
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
    cuda_total = sum(e.self_device_time_total for e in prof.key_averages()  # kernels, not the step annotations
                     if not e.key.startswith("ProfilerStep")) / 1e3 / active
    lines = [f"seq {a.seq_len} x batch {a.batch_size}, loss chunk {a.loss_chunk}; step times (s): "
             + " ".join(f"{t:.3f}" for t in times),
             f"median of the profiled steps: {statistics.median(times[-active:]):.3f} s; CUDA kernel time per "
             f"profiled step: {cuda_total:.1f} ms", table]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "draft_train_profile.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
