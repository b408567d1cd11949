"""Single-GPU draft-training throughput (tokens/s) for a small random Llama target, bf16, on Python source text.

Usage (GPU): ``python -m benchmarks.bench_train --steps 30``. The corpus is the Python standard library's source
files (whatever this machine has); tokens are bytes (ids 3..258) inside the target's 32k vocabulary, so the LM head
costs what a real 32k-vocabulary run costs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sysconfig
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.harness import write_results
from longspec.train.data import DataConfig
from longspec.train.tokenizer import ByteTokenizer
from longspec.train.trainer import TrainConfig, train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                      tie_word_embeddings=False)
    target = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    with tempfile.TemporaryDirectory() as out:
        tc = TrainConfig(data=DataConfig(paths=files, seq_len=a.seq_len), out_dir=out, steps=a.steps,
                         batch_size=a.batch_size, lr=1e-3, save_every=10**9, log_every=10, progress=False)
        hist = train(tc, target, ByteTokenizer())
    tps = statistics.median(h["tokens_per_s"] for h in hist[5:])
    params = sum(p.numel() for p in target.parameters())
    row = {"target_params": params, "seq_len": a.seq_len, "batch_size": a.batch_size, "steps": a.steps,
           "median_tokens_per_s": tps, "loss_first": hist[0]["loss"], "loss_last": hist[-1]["loss"]}
    print(json.dumps(row))
    write_results("train", [row], a.out, meta={"history": hist}, title="Single-GPU draft-training throughput",
                  notes=["`python -m benchmarks.bench_train`: a random 8-layer Llama target, bytes of Python source"])


if __name__ == "__main__":
    main()
