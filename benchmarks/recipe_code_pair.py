"""The recipe for a real target/draft pair on Python code (issue 7): corpus -> tokenizer -> target -> LongSpec draft.

Usage: ``python -m benchmarks.recipe_code_pair --out DIR [--scale tiny|h200] [--roots DIR ...]``

1. Corpus: the Python source installed on the machine (stdlib + site-packages), split by top-level package into
   ``DIR/corpus/train.jsonl`` and ``heldout.jsonl`` (:mod:`longspec.train.corpus`).
2. Tokenizer: byte-level BPE on the training split (``DIR/target``, next to the model).
3. Target: a Llama-architecture model trained from scratch with plain AdamW + linear warm-up + cosine decay and
   gradient clipping, bf16 autocast on CUDA, on random windows of the pre-tokenised training split (a uint16
   memmap, so no tokenisation sits in the loop); saved with ``save_pretrained`` + the tokenizer to ``DIR/target``.
4. Draft: the LongSpec draft trained with the project's trainer (``longspec.train.train``, anchor-offset and flash
   noisy on) on a stride sample of the training split that spans every package; ``DIR/draft/checkpoint-<steps>``.
5. ``DIR/recipe.json``: config, seeds, corpus sizes, losses (first / last / every ``log_every`` steps, and the
   target's held-out loss) and wall time per stage.

Scales. ``tiny``: seconds on a CPU (seq 256, a handful of steps): it tests the pipeline, not the model. ``h200``:
vocab 8192; target hidden 512, 8 layers, 8 heads / 2 KV heads, MLP 1408, untied head (about 31M parameters),
rope_theta 1e6, max_position_embeddings 65536 (32k prompts plus generation fit); target 1600 steps x 8 x 8192
tokens (105M tokens, about one epoch of a ~400 MB corpus at ~3.3 characters per token); draft 800 steps x 4 x 8192
(26M tokens).

Estimated h200 wall time -- UNMEASURED, from: draft training measured at 422,818 tokens/s (55M target, seq 4096,
batch 4, bf16), a 30M target's own training assumed at ~300k tokens/s at seq 8192, and this tokenizer encoding
~1.8 MB/s (~580k tokens/s) single-threaded on a CPU core here (the draft trainer tokenises in its loop, so its
effective rate is about 1 / (1/422k + 1/580k) = ~245k tokens/s):
corpus ~1 min; tokenizer (100M characters) ~0.5 min; pre-tokenising ~1 min (batched, multi-threaded); target 105M
tokens ~6 min; draft 26M tokens ~2 min; saving ~0.1 min. Total about 10-11 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from longspec.train.corpus import build_corpus, iter_records
from longspec.train.data import DataConfig
from longspec.train.tokenizer import train_bpe_tokenizer
from longspec.train.trainer import TrainConfig, train, warmup_cosine

SEED = 0


@dataclass(frozen=True)
class Scale:
    """Every knob of one recipe size."""

    name: str
    corpus_max_chars: int | None
    heldout_frac: float
    vocab_size: int
    tokenizer_max_chars: int | None
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int
    rope_theta: float
    target_seq: int
    target_batch: int
    target_steps: int
    target_lr: float
    target_warmup: int
    draft_seq: int
    draft_batch: int
    draft_steps: int
    draft_lr: float
    log_every: int
    eval_windows: int


SCALES = {
    "tiny": Scale("tiny", corpus_max_chars=2_000_000, heldout_frac=0.1, vocab_size=512,
                  tokenizer_max_chars=1_000_000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                  max_positions=4096, rope_theta=500000.0, target_seq=256, target_batch=2, target_steps=4,
                  target_lr=3e-3, target_warmup=1, draft_seq=256, draft_batch=2, draft_steps=3, draft_lr=3e-3,
                  log_every=1, eval_windows=2),
    "h200": Scale("h200", corpus_max_chars=None, heldout_frac=0.1, vocab_size=8192,
                  tokenizer_max_chars=100_000_000, hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=2,
                  max_positions=65536, rope_theta=1_000_000.0, target_seq=8192, target_batch=8, target_steps=1600,
                  target_lr=1.5e-3, target_warmup=100, draft_seq=8192, draft_batch=4, draft_steps=800,
                  draft_lr=1e-3, log_every=20, eval_windows=16),
}


# --- tokens on disk -----------------------------------------------------------------------------------------------


def pretokenize(jsonl: str, tokenizer, out_path: str, max_chars: int | None = None, batch_records: int = 512) -> int:
    """Write the records' token ids, each document followed by EOS, as a flat uint16 file; return the count.

    Batched calls let the Rust tokenizer use every core; records are streamed, never all in memory.
    """
    if len(tokenizer) > 1 << 16:
        raise ValueError("uint16 token files need a vocabulary of at most 65536")
    eos, total, chars, batch = tokenizer.eos_token_id, 0, 0, []
    with open(out_path, "wb") as f:
        for rec in iter_records(jsonl):
            batch.append(rec["text"])
            chars += len(rec["text"])
            if len(batch) == batch_records or (max_chars is not None and chars >= max_chars):
                total += _write_batch(f, tokenizer, batch, eos)
                batch = []
                if max_chars is not None and chars >= max_chars:
                    break
        if batch:
            total += _write_batch(f, tokenizer, batch, eos)
    return total


def _write_batch(f, tokenizer, texts: list[str], eos: int) -> int:
    ids = [x + [eos] for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    flat = np.fromiter((t for doc in ids for t in doc), dtype=np.uint16)
    flat.tofile(f)
    return int(flat.size)


def random_windows(tokens: np.ndarray, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """LongTensor [batch, seq_len]: windows at uniformly drawn offsets (windows may cross document EOS marks)."""
    if tokens.size < seq_len:
        raise ValueError(f"the token file holds {tokens.size} tokens, fewer than seq_len {seq_len}")
    starts = torch.randint(0, tokens.size - seq_len + 1, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s:s + seq_len].astype(np.int64) for s in starts]))


# --- target -------------------------------------------------------------------------------------------------------


def build_target(s: Scale, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      max_position_embeddings=s.max_positions, rope_theta=s.rope_theta, tie_word_embeddings=False,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def train_target(model, tokens: np.ndarray, s: Scale, device: torch.device) -> list[dict]:
    """Plain AdamW + warm-up/cosine, clip 1.0, bf16 autocast on CUDA (fp32 master weights); returns log rows."""
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=s.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(s.target_warmup, s.target_steps))
    gen = torch.Generator().manual_seed(SEED + 1)
    use_bf16 = device.type == "cuda"
    history = []
    for step in range(1, s.target_steps + 1):
        ids = random_windows(tokens, s.target_seq, s.target_batch, gen).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step == 1 or step % s.log_every == 0 or step == s.target_steps:
            # Only logged steps sync the device.
            history.append({"step": step, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                            "lr": sched.get_last_lr()[0]})
            print(f"target step {step}: loss {history[-1]['loss']:.4f}", flush=True)
    return history


@torch.no_grad()
def eval_loss(model, tokens: np.ndarray, s: Scale, device: torch.device) -> float:
    """Mean LM loss on ``eval_windows`` seeded windows (one at a time: bounded memory at long seq_len)."""
    model.eval()
    gen = torch.Generator().manual_seed(SEED + 2)
    seq = min(s.target_seq, tokens.size)
    losses = []
    for _ in range(s.eval_windows):
        ids = random_windows(tokens, seq, 1, gen).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    return sum(losses) / len(losses)


# --- draft --------------------------------------------------------------------------------------------------------


def stride_sample(jsonl: str, out_path: str, want_chars: int) -> int:
    """Every k-th record of ``jsonl`` into ``out_path`` so about ``want_chars`` characters span all packages (the
    draft trainer streams its files in order, and the corpus is sorted by package). Returns the records written."""
    total = sum(len(r["text"]) for r in iter_records(jsonl))
    k = max(1, total // max(1, want_chars))
    written = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for i, rec in enumerate(iter_records(jsonl)):
            if i % k == 0:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                written += 1
    return written


# The main draft and the two ablations: (anchor_offset, flash_noisy) per variant.
DRAFT_VARIANTS = {"draft": (True, True), "draft_no_anchor": (False, True), "draft_no_noisy": (True, False)}


def train_draft(target, tokenizer, data_jsonl: str, out_dir: str, s: Scale, anchor_offset: bool = True,
                flash_noisy: bool = True) -> tuple[list[dict], str]:
    cfg = TrainConfig(data=DataConfig(paths=[data_jsonl], seq_len=s.draft_seq), out_dir=out_dir,
                      steps=s.draft_steps, batch_size=s.draft_batch, lr=s.draft_lr, anchor_offset=anchor_offset,
                      flash_noisy=flash_noisy, save_every=s.draft_steps, log_every=s.log_every, progress=False,
                      seed=SEED)
    history = train(cfg, target, tokenizer)
    return history, os.path.join(out_dir, f"checkpoint-{s.draft_steps}")


# --- the recipe ---------------------------------------------------------------------------------------------------


def steps_to_loss(history: list[dict], level: float, smooth: int = 20) -> int | None:
    """First step whose trailing ``smooth``-step mean loss is at or below ``level`` (None if never)."""
    losses = [h["loss"] for h in history]
    for i in range(len(losses)):
        window = losses[max(0, i - smooth + 1): i + 1]
        if sum(window) / len(window) <= level:
            return history[i]["step"]
    return None


def ablation_summary(histories: dict[str, list[dict]], smooth: int = 20) -> dict:
    """Training steps each variant needs to reach the loss that every variant reaches (the worst final loss)."""
    finals = {k: sum(h["loss"] for h in v[-smooth:]) / len(v[-smooth:]) for k, v in histories.items()}
    level = max(finals.values())
    return {"level": level, "final_loss": finals,
            "steps_to_level": {k: steps_to_loss(v, level, smooth) for k, v in histories.items()}}


def _loss_summary(history: list[dict], every: int) -> dict:
    return {"first": history[0]["loss"], "last": history[-1]["loss"],
            "every": every, "curve": [(h["step"], round(h["loss"], 5)) for h in history
                                      if h["step"] == 1 or h["step"] % every == 0 or h is history[-1]]}


def run_recipe(out: str, scale: str | Scale = "tiny", roots: Sequence[str] | None = None,
               device: str | torch.device | None = None, ablations: bool = False) -> dict:
    """Run every stage into ``out`` and return (and write) the ``recipe.json`` record."""
    from transformers import AutoTokenizer

    s = SCALES[scale] if isinstance(scale, str) else scale
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(SEED)
    os.makedirs(out, exist_ok=True)
    times, t = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        times[name] = round(now - t, 3)
        t = now

    corpus = build_corpus(os.path.join(out, "corpus"), roots=roots, heldout_frac=s.heldout_frac,
                          max_chars=s.corpus_max_chars)
    lap("corpus")
    target_dir = os.path.join(out, "target")
    train_bpe_tokenizer([corpus.train_jsonl], s.vocab_size, target_dir, max_chars=s.tokenizer_max_chars)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    lap("tokenizer")
    n_train = pretokenize(corpus.train_jsonl, tokenizer, os.path.join(out, "corpus", "train.u16"))
    n_held = pretokenize(corpus.heldout_jsonl, tokenizer, os.path.join(out, "corpus", "heldout.u16"),
                         max_chars=s.eval_windows * s.target_seq * 8)
    train_tokens = np.memmap(os.path.join(out, "corpus", "train.u16"), dtype=np.uint16, mode="r")
    # np.memmap refuses empty files; a tiny corpus may hold out nothing.
    held_tokens = np.memmap(os.path.join(out, "corpus", "heldout.u16"), dtype=np.uint16, mode="r") if n_held else None
    lap("pretokenize")
    target = build_target(s, tokenizer)
    target_hist = train_target(target, train_tokens, s, dev)
    heldout_loss = eval_loss(target, held_tokens, s, dev) if held_tokens is not None and n_held > 1 else None
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    lap("target")
    draft_data = os.path.join(out, "corpus", "draft.jsonl")
    draft_chars = int(s.draft_steps * s.draft_batch * s.draft_seq * 3.5 * 1.2)  # ~3.3 chars/token, 20% spare
    stride_sample(corpus.train_jsonl, draft_data, draft_chars)
    target.eval()
    histories, checkpoints = {}, {}
    for name, (anchor, noisy) in DRAFT_VARIANTS.items():
        if name != "draft" and not ablations:
            continue
        histories[name], checkpoints[name] = train_draft(target, tokenizer, draft_data, os.path.join(out, name), s,
                                                         anchor_offset=anchor, flash_noisy=noisy)
        lap(name)
    draft_hist, draft_ckpt = histories["draft"], checkpoints["draft"]
    record = {
        "scale": asdict(s), "seeds": {"torch": SEED, "target_windows": SEED + 1, "eval_windows": SEED + 2,
                                      "draft": SEED},
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "corpus": {"packages": corpus.packages, "files": corpus.files, "chars": corpus.chars,
                   "skipped_files": corpus.skipped_files, "train_tokens": n_train, "heldout_tokens_sampled": n_held},
        "target": {"dir": target_dir, "params": sum(p.numel() for p in target.parameters()),
                   "loss": _loss_summary(target_hist, s.log_every), "heldout_loss": heldout_loss},
        "draft": {"checkpoint": draft_ckpt, "loss": _loss_summary(draft_hist, s.log_every),
                  "median_tokens_per_s": float(np.median([h["tokens_per_s"] for h in draft_hist]))},
        "wall_s": times, "total_wall_s": round(sum(times.values()), 3),
    }
    if ablations:
        record["ablations"] = {"checkpoints": checkpoints, **ablation_summary(histories),
                               "loss": {k: _loss_summary(v, s.log_every) for k, v in histories.items()}}
    with open(os.path.join(out, "recipe.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--roots", nargs="*", default=None, help="package roots (default: stdlib + site-packages)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--ablations", action="store_true", help="also train drafts without anchor-offset / flash noisy")
    a = ap.parse_args(argv)
    record = run_recipe(a.out, a.scale, a.roots, a.device, ablations=a.ablations)
    print(json.dumps({k: record[k] for k in ("corpus", "wall_s", "total_wall_s")}, indent=1))
    print(json.dumps({"target_loss": record["target"]["loss"]["last"], "heldout_loss": record["target"]["heldout_loss"],
                      "draft_loss": record["draft"]["loss"]["last"]}))


if __name__ == "__main__":
    main()
