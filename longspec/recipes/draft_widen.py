"""Does widening a trained draft's MLP (:func:`~longspec.model.draft_grow.widen_mlp`) accept more than training it
on at its own width, for the same further steps?

The CPU companion of the pair recipe's ``long_draft_intermediate``: :mod:`longspec.recipes.draft_objective`'s
byte-level target and data; per seed a LongSpec draft trained by pure distillation (KL to the target) for
``--draft-steps``, then two continuations of ``--draft-steps`` more from it, one at its width and one with its MLP
widened ``--ratio`` times; tau (tokens per target forward, greedy) of all three on held-out prompts with the 4-4-4-4
tree and a chain of 4. A toy: its draft is one block beside a 3-layer target, so it says whether the extra units
learn at all, not what they are worth beside a deep target. Usage: ``python -m longspec.recipes.draft_widen
[--seeds 0 1]`` (about four minutes a seed on two CPU cores).
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

from longspec import LongSpecDraft
from longspec.model.draft_grow import widen_mlp
from longspec.recipes.draft_objective import OUT, setup, tau_row, write_result
from longspec.train.data import DataConfig
from longspec.train.tokenizer import ByteTokenizer
from longspec.train.trainer import TrainConfig, train


def distil(target, files: list[str], steps: int, seed: int, draft=None) -> tuple[LongSpecDraft, float]:
    """``steps`` of pure distillation (a fresh warm-up + cosine schedule) from ``draft`` (None: a new draft);
    returns the trained draft and its last step's loss. ``draft`` is trained in place."""
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data=DataConfig(paths=files, seq_len=512), out_dir=out, steps=steps, batch_size=4,
                          lr=2e-3, save_every=10**9, log_every=50, progress=False, seed=seed, kl_weight=1.0,
                          ce_weight=0.0)
        hist = train(cfg, target, ByteTokenizer(), draft=draft)
        return LongSpecDraft.from_pretrained(os.path.join(out, f"checkpoint-{steps}"), target=target), hist[-1]["loss"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--draft-steps", type=int, default=300, help="steps of the first run and of each continuation")
    ap.add_argument("--ratio", type=int, default=2, help="the widened MLP's units over the draft's")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    if a.ratio < 2:
        raise SystemExit(f"--ratio must be an int >= 2, got {a.ratio}")
    t0 = time.time()
    train_files, target, prompts = setup(a.target_steps)
    rows = []
    for seed in a.seeds:
        base, base_loss = distil(target, train_files, a.draft_steps, seed)
        width = base.config.intermediate_size
        arms = {"first run": (base, base_loss)}
        arms["on at its width"] = distil(target, train_files, a.draft_steps, seed + 1000, copy.deepcopy(base))
        arms[f"widened x{a.ratio}"] = distil(target, train_files, a.draft_steps, seed + 1000,
                                            widen_mlp(base, a.ratio * width, seed=seed))
        for name, (draft, loss) in arms.items():
            row = {"seed": seed, "draft": name, "intermediate": draft.config.intermediate_size,
                   "steps": a.draft_steps * (1 if name == "first run" else 2), "final_kl": loss,
                   **tau_row(target, draft, prompts)}
            print(row, flush=True)
            rows.append(row)
    write_result(a.out, "draft_widen", rows, a.target_steps, t0, objective="KL to the target (ce_weight 0)",
                 draft_batch="4 x 512 tokens")


if __name__ == "__main__":
    main()
