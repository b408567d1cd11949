"""Which draft objective accepts more: next-token cross-entropy on the data (the paper), CE + KL to the target, or
KL to the target alone (pure distillation)?

A small experiment that runs on a CPU in a few minutes: train a small byte-level Llama target on Python source
(standard-library files, split by file into training and held-out sets), then for each draft seed three LongSpec
drafts for it from the same initialisation with the project's trainer (anchor-offset positions and flash noisy
training on), one per objective (``ce_weight`` / ``kl_weight`` 1 / 0, 1 / 1 and 0 / 1); measure tau (tokens per
target forward, greedy) of each on held-out prompts with the 4-4-4-4 tree and a chain of 4. Usage: ``python -m
longspec.recipes.draft_objective [--seeds 0 1 2]``.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sysconfig
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from longspec import LongSpecDraft, LongSpecDrafter, SpeculativeDecoder
from longspec.train.data import DataConfig, PackedStream, batches
from longspec.train.tokenizer import ByteTokenizer
from longspec.train.trainer import TrainConfig, train

OUT = os.path.join("benchmarks", "results", "cpu")  # results, relative to the repository root where these run


def source_files() -> tuple[list[str], list[str]]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    files = [f for f in files if 2000 < os.path.getsize(f) < 200_000]
    return files[1::2], files[0::2][:40]  # training, held-out (disjoint files)


def train_target(files: list[str], steps: int, seq_len: int, batch: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    data = batches(PackedStream(DataConfig(paths=files, seq_len=seq_len), ByteTokenizer()), batch)
    for step in range(steps):
        ids = next(data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"target step {step}: loss {loss.item():.3f}", flush=True)
    return model.eval()


def held_out_prompts(files: list[str], n: int, length: int) -> list[torch.Tensor]:
    tok, prompts = ByteTokenizer(), []
    for f in files:
        ids = tok(open(f, encoding="utf-8", errors="replace").read())["input_ids"]
        if len(ids) > length:
            prompts.append(torch.tensor(ids[:length])[None])
        if len(prompts) == n:
            break
    return prompts


def tau(target, draft, prompts, shape, new_tokens: int) -> float:
    dec = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=shape)
    emitted = forwards = 0
    for p in prompts:
        out = dec.generate(p, new_tokens, eos_token_id=[])
        emitted += sum(sum(a) for a in out.accept_lengths)
        forwards += sum(len(a) for a in out.accept_lengths)
    return emitted / forwards


def tau_row(target, draft, prompts) -> dict:
    """The draft's tau on ``prompts`` with the 4-4-4-4 tree and with a chain of 4 (48 new tokens, greedy)."""
    return {"tau_tree_4-4-4-4": tau(target, draft, prompts, (4, 4, 4, 4), 48),
            "tau_chain_4": tau(target, draft, prompts, (1, 1, 1, 1), 48)}


def write_result(out: str, name: str, rows: list[dict], target_steps: int, started: float, **meta) -> None:
    """``out/name.json``: the rows and what every CPU draft experiment here shares (target, prompts, device, time)."""
    meta = {"target": "byte-level Llama, 3 layers, hidden 192, trained %d steps x 8 x 256 tokens" % target_steps,
            **meta, "prompts": "8 held-out stdlib files, first 1024 bytes, 48 new tokens, greedy", "device": "cpu",
            "torch": torch.__version__, "seconds": round(time.time() - started, 1)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def setup(target_steps: int) -> tuple[list[str], LlamaForCausalLM, list[torch.Tensor]]:
    """Every CPU draft experiment's start: the training files, the target trained on them, the held-out prompts."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    train_files, held = source_files()
    target = train_target(train_files, target_steps, seq_len=256, batch=8)
    return train_files, target, held_out_prompts(held, n=8, length=1024)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--draft-steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="draft seeds (initialisation and data order)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    t0 = time.time()
    train_files, target, prompts = setup(a.target_steps)
    rows = []
    for seed, (name, ce, kl) in itertools.product(a.seeds, (("CE", 1.0, 0.0), ("CE + 1.0 KL", 1.0, 1.0),
                                                            ("KL", 0.0, 1.0))):
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainConfig(data=DataConfig(paths=train_files, seq_len=512), out_dir=out, steps=a.draft_steps,
                              batch_size=4, lr=2e-3, save_every=10**9, log_every=50, progress=False, seed=seed,
                              kl_weight=kl, ce_weight=ce)
            hist = train(cfg, target, ByteTokenizer())
            draft = LongSpecDraft.from_pretrained(os.path.join(out, f"checkpoint-{a.draft_steps}"), target=target)
        row = {"objective": name, "seed": seed, "final_loss": hist[-1]["loss"], **tau_row(target, draft, prompts)}
        print(row, flush=True)
        rows.append(row)
    write_result(a.out, "draft_objective", rows, a.target_steps, t0, draft_steps=a.draft_steps,
                 draft_batch="4 x 512 tokens")


if __name__ == "__main__":
    main()
