"""The recipe for a real target/draft pair on Python code (issue 7): corpus -> tokenizer -> target -> LongSpec draft.

Usage: ``python -m longspec.recipes.code_pair --out DIR [--scale tiny|h200] [--ablations] [--stages ...]``

1. Corpus: the Python source installed on the machine (stdlib + site-packages), split by top-level package into
   ``DIR/corpus/train.jsonl`` and ``heldout.jsonl`` (:mod:`longspec.train.corpus`).
2. Tokenizer: byte-level BPE on the training split (``DIR/target``, next to the model).
3. Target: a Llama-architecture model trained from scratch with plain AdamW + linear warm-up + cosine decay and
   gradient clipping, bf16 autocast on CUDA, on random windows of the pre-tokenised training split (a uint16
   memmap, so no tokenisation sits in the loop); saved in bfloat16 (the weights every later stage and the shipped
   pair use) with the tokenizer to ``DIR/target``.
4. Draft: the LongSpec draft trained with the project's trainer (``longspec.train.train``, anchor-offset and flash
   noisy on) against that bf16 target, on a stride sample of the training split that spans every package;
   ``DIR/draft/checkpoint-<steps>``. ``--ablations`` adds the same run without anchor-offset and without flash
   noisy (same steps, seed and data).
5. ``DIR/recipe.json``: config, seeds, corpus sizes, losses (first / last / every ``log_every`` steps, and the
   target's held-out loss) and wall time per stage, updated after every stage.

Stages (``--stages data target drafts``, all by default) skip work whose output exists, so the recipe can run in
several processes (or machines) over one ``DIR``: ``data`` writes the corpus, the tokenizer and the token file;
``target`` needs the token file; ``drafts`` rebuilds a missing corpus but never retrains the tokenizer.

Step counts. At ``tiny`` they are fixed. At ``h200`` each training run gets a wall-clock budget: a short probe
times a few steps and the run takes ``budget / step time`` steps (capped), so the schedule is a plain fixed-step
cosine; the chosen counts are in ``recipe.json`` and ``--target-steps`` / ``--draft-steps`` replay them exactly.

Scales. ``tiny``: seconds on a CPU (seq 256, a handful of steps): it tests the pipeline, not the model. ``h200``:
vocab 8192; target hidden 384, 8 layers, 6 heads / 2 KV heads (head dim 64), MLP 1024, tied embeddings (about
15.7M parameters, 31 MB in bf16, so that target + draft + tokenizer ship in under 40 MB), rope_theta 1e6,
max_position_embeddings 65536 (32k prompts plus generation fit); target seq 8192 x batch 8 for 300 s, of which the
last quarter of the steps train on 32k-token windows (batch 2); each draft seq 8192 x batch 4 for 120 s.
(The shipped pair, ``benchmarks/results/h200/recipe.json``, predates the long-window quarter: its target saw 8k
windows only, and its tau falls beyond 8k. The long-window schedule has run at the tiny scale only.)
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
    """Every knob of one recipe size. ``*_seconds`` set: the step count comes from a timed probe (capped by
    ``*_steps``); None: exactly ``*_steps`` steps."""

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
    tie_embeddings: bool
    max_positions: int
    rope_theta: float
    target_seq: int
    target_batch: int
    target_long_seq: int  # the last target_long_ratio of the steps train on windows this long
    target_long_ratio: float  # (batch scaled down to keep the tokens per step), as long-context models are trained
    target_steps: int
    target_seconds: float | None
    target_lr: float
    target_warmup_ratio: float
    draft_seq: int
    draft_batch: int
    draft_steps: int
    draft_seconds: float | None
    draft_lr: float
    log_every: int
    eval_windows: int


SCALES = {
    "tiny": Scale("tiny", corpus_max_chars=2_000_000, heldout_frac=0.1, vocab_size=512,
                  tokenizer_max_chars=1_000_000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                  tie_embeddings=True, max_positions=4096, rope_theta=500000.0, target_seq=256, target_batch=2,
                  target_long_seq=512, target_long_ratio=0.5,
                  target_steps=4, target_seconds=None, target_lr=3e-3, target_warmup_ratio=0.25, draft_seq=256,
                  draft_batch=2, draft_steps=3, draft_seconds=None, draft_lr=3e-3, log_every=1, eval_windows=2),
    "h200": Scale("h200", corpus_max_chars=None, heldout_frac=0.1, vocab_size=8192,
                  tokenizer_max_chars=100_000_000, hidden=384, intermediate=1024, layers=8, heads=6, kv_heads=2,
                  tie_embeddings=True, max_positions=65536, rope_theta=1_000_000.0, target_seq=8192,
                  target_batch=8, target_long_seq=32768, target_long_ratio=0.25, target_steps=4000,
                  target_seconds=300.0, target_lr=2e-3, target_warmup_ratio=0.05,
                  draft_seq=8192, draft_batch=4, draft_steps=3000, draft_seconds=120.0, draft_lr=1e-3,
                  log_every=20, eval_windows=16),
}
STAGES = ("data", "target", "drafts")


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
                      max_position_embeddings=s.max_positions, rope_theta=s.rope_theta,
                      tie_word_embeddings=s.tie_embeddings, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


class _TargetTrainer:
    """One AdamW + warm-up/cosine run over ``steps`` steps: clip 1.0, bf16 autocast on CUDA (fp32 master weights)."""

    def __init__(self, model, tokens: np.ndarray, s: Scale, steps: int, device: torch.device):
        self.model, self.tokens, self.s, self.device = model.to(device).train(), tokens, s, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=s.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, warmup_cosine(max(1, int(s.target_warmup_ratio * steps)), steps))
        self.gen = torch.Generator().manual_seed(SEED + 1)
        self.long_from = steps - int(round(s.target_long_ratio * steps))  # steps after this one are long
        self.done = 0

    def step(self, long: bool | None = None):
        """One step; ``long`` forces the window length (the probe times both), default: by the schedule."""
        s = self.s
        self.done += 1
        long = self.done > self.long_from if long is None else long
        seq, batch = long_window(s) if long else (s.target_seq, s.target_batch)
        ids = random_windows(self.tokens, seq, batch, self.gen).to(self.device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), grad_norm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def long_window(s: Scale) -> tuple[int, int]:
    """(seq, batch) of the long-window steps: about the tokens of a normal step."""
    return s.target_long_seq, max(1, s.target_batch * s.target_seq // s.target_long_seq)


def probe_target_step_s(s: Scale, tokenizer, tokens: np.ndarray, device: torch.device, warm: int = 2,
                        timed: int = 4) -> float:
    """Mean seconds per target training step over the schedule (normal and long windows weighted by their share),
    timed on a throwaway model (the real run starts from the seeded init)."""
    trainer = _TargetTrainer(build_target(s, tokenizer), tokens, s, 2 * (warm + timed), device)
    per_step = {}
    for long in (False, True):
        for _ in range(warm):
            trainer.step(long)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(timed):
            trainer.step(long)
        _sync(device)
        per_step[long] = (time.perf_counter() - t0) / timed
    return (1 - s.target_long_ratio) * per_step[False] + s.target_long_ratio * per_step[True]


def _target_tokens(s: Scale, steps: int) -> int:
    n_long = int(round(s.target_long_ratio * steps))
    seq, batch = long_window(s)
    return (steps - n_long) * s.target_batch * s.target_seq + n_long * seq * batch


def budget_steps(seconds: float, step_s: float, cap: int) -> int:
    return max(1, min(cap, int(seconds / step_s)))


def train_target(model, tokens: np.ndarray, s: Scale, steps: int, device: torch.device) -> list[dict]:
    """Train ``model`` for ``steps`` steps; returns the log rows (only logged steps sync the device)."""
    trainer = _TargetTrainer(model, tokens, s, steps, device)
    history = []
    for step in range(1, steps + 1):
        loss, grad_norm = trainer.step()
        if step == 1 or step % s.log_every == 0 or step == steps:
            history.append({"step": step, "loss": float(loss), "grad_norm": float(grad_norm),
                            "lr": trainer.sched.get_last_lr()[0]})
            print(f"target step {step}/{steps}: loss {history[-1]['loss']:.4f}", flush=True)
    return history


@torch.no_grad()
def eval_loss(model, tokens: np.ndarray, s: Scale, device: torch.device, seq: int | None = None,
              windows: int | None = None) -> float:
    """Mean LM loss on seeded windows of ``seq`` tokens (default the training length; one window at a time:
    bounded memory at long seq_len)."""
    model.eval()
    gen = torch.Generator().manual_seed(SEED + 2)
    seq = min(seq or s.target_seq, tokens.size)
    losses = []
    for _ in range(windows or s.eval_windows):
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


def train_draft(target, tokenizer, data_jsonl: str, out_dir: str, s: Scale, steps: int, anchor_offset: bool = True,
                flash_noisy: bool = True) -> tuple[list[dict], str]:
    cfg = TrainConfig(data=DataConfig(paths=[data_jsonl], seq_len=s.draft_seq), out_dir=out_dir, steps=steps,
                      batch_size=s.draft_batch, lr=s.draft_lr, anchor_offset=anchor_offset, flash_noisy=flash_noisy,
                      save_every=steps, log_every=s.log_every, progress=False, seed=SEED)
    history = train(cfg, target, tokenizer)
    return history, os.path.join(out_dir, f"checkpoint-{steps}")


def probe_draft_step_s(target, tokenizer, data_jsonl: str, s: Scale, tmp_dir: str, steps: int = 8) -> float:
    """Seconds per draft training step: the median of a short run's later steps (into a scratch directory)."""
    import shutil

    history, _ = train_draft(target, tokenizer, data_jsonl, tmp_dir, s, steps)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tokens = s.draft_batch * s.draft_seq
    return float(np.median([tokens / h["tokens_per_s"] for h in history[steps // 2:]]))


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
            "every": every, "curve": [[h["step"], round(h["loss"], 5)] for h in history
                                      if h["step"] == 1 or h["step"] % every == 0 or h is history[-1]]}


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run_recipe(out: str, scale: str | Scale = "tiny", roots: Sequence[str] | None = None,
               device: str | torch.device | None = None, ablations: bool = False, stages: Sequence[str] = STAGES,
               target_steps: int | None = None, draft_steps: int | None = None) -> dict:
    """Run ``stages`` into ``out`` (skipping work already there) and return (and write) the ``recipe.json`` record.

    target_steps / draft_steps override the scale's step counts and budgets (to replay a recorded run).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages must be among {STAGES}, got {sorted(unknown)}")
    s = SCALES[scale] if isinstance(scale, str) else scale
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(out, exist_ok=True)
    record_path = os.path.join(out, "recipe.json")
    record = _read_json(record_path)
    if record.get("scale", asdict(s)) != asdict(s):
        raise ValueError(f"{out} holds a recipe of another scale ({record['scale']['name']}); use a fresh --out")
    record.update(scale=asdict(s), seeds={"torch": SEED, "target_windows": SEED + 1, "eval_windows": SEED + 2,
                                          "draft": SEED},
                  device=str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev), torch=torch.__version__)
    times = record.setdefault("wall_s", {})
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        times[name] = round(now - t, 3)
        t = now
        record["total_wall_s"] = round(sum(times.values()), 3)
        _write_json(record_path, record)

    corpus_dir, target_dir = os.path.join(out, "corpus"), os.path.join(out, "target")
    train_jsonl, heldout_jsonl = os.path.join(corpus_dir, "train.jsonl"), os.path.join(corpus_dir, "heldout.jsonl")
    corpus_stats = os.path.join(corpus_dir, "stats.json")
    if not os.path.isfile(corpus_stats) and ("data" in stages or "drafts" in stages):
        corpus = build_corpus(corpus_dir, roots=roots, heldout_frac=s.heldout_frac, max_chars=s.corpus_max_chars)
        stats = {"packages": corpus.packages, "files": corpus.files, "chars": corpus.chars,
                 "skipped_files": corpus.skipped_files}
        seen = {k: record["corpus"][k] for k in stats if k in record.get("corpus", {})}
        if seen and seen != {k: stats[k] for k in seen}:
            raise ValueError(f"the rebuilt corpus {stats} differs from the recorded one {seen} (other packages?)")
        _write_json(corpus_stats, stats)
        record["corpus"] = {**record.get("corpus", {}), **stats}
        lap("corpus")
    if "data" in stages and not os.path.isfile(os.path.join(target_dir, "tokenizer.json")):
        train_bpe_tokenizer([train_jsonl], s.vocab_size, target_dir, max_chars=s.tokenizer_max_chars)
        lap("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokens_file, held_file = os.path.join(corpus_dir, "train.u16"), os.path.join(corpus_dir, "heldout.u16")
    if "data" in stages and "train_tokens" not in record.get("corpus", {}):
        record["corpus"]["train_tokens"] = pretokenize(train_jsonl, tokenizer, tokens_file)
        record["corpus"]["heldout_tokens_sampled"] = pretokenize(heldout_jsonl, tokenizer, held_file,
                                                                 max_chars=s.eval_windows * s.target_seq * 8)
        lap("pretokenize")

    if "target" in stages and "target" not in record:
        train_tokens = np.memmap(tokens_file, dtype=np.uint16, mode="r")
        steps, step_s = target_steps, None
        if steps is None and s.target_seconds is not None:
            step_s = probe_target_step_s(s, tokenizer, train_tokens, dev)
            steps = budget_steps(s.target_seconds, step_s, s.target_steps)
        steps = steps or s.target_steps
        target = build_target(s, tokenizer)
        history = train_target(target, train_tokens, s, steps, dev)
        # Every later stage, the benchmarks and the shipped pair use the bf16-rounded weights: evaluate those.
        target = target.to(torch.bfloat16).eval()
        n_held = record["corpus"]["heldout_tokens_sampled"]
        # np.memmap refuses empty files; a tiny corpus may hold out nothing.
        held = np.memmap(held_file, dtype=np.uint16, mode="r") if n_held > 1 else None
        record["target"] = {"dir": target_dir, "params": sum(p.numel() for p in target.parameters()),
                            "steps": steps, "probe_step_s": step_s, "saved_dtype": "bfloat16",
                            "tokens_seen": _target_tokens(s, steps),
                            "loss": _loss_summary(history, s.log_every),
                            "heldout_loss": eval_loss(target, held, s, dev) if held is not None else None,
                            "heldout_loss_long": eval_loss(target, held, s, dev, s.target_long_seq,
                                                           max(1, s.eval_windows // 4)) if held is not None else None}
        target.save_pretrained(target_dir)
        tokenizer.save_pretrained(target_dir)
        del target
        lap("target")

    if "drafts" in stages:
        if "target" not in record:
            raise ValueError(f"stage 'drafts' needs the target: run stage 'target' into {out} first")
        # float32 copies of the bf16 weights: fp32 master weights for the draft, bf16 autocast in the trainer.
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(dev).eval()
        draft_data = os.path.join(corpus_dir, "draft.jsonl")
        steps, step_s = draft_steps or record.get("draft", {}).get("steps"), None
        if not os.path.isfile(draft_data):
            cap = steps or s.draft_steps
            stride_sample(train_jsonl, draft_data, int(cap * s.draft_batch * s.draft_seq * 3.5 * 1.2))
        if steps is None and s.draft_seconds is not None:
            step_s = probe_draft_step_s(target, tokenizer, draft_data, s, os.path.join(out, "draft_probe"))
            steps = budget_steps(s.draft_seconds, step_s, s.draft_steps)
        steps = steps or s.draft_steps
        histories = record.setdefault("draft_histories", {})
        checkpoints = {}
        for name, (anchor, noisy) in DRAFT_VARIANTS.items():
            if name != "draft" and not ablations:
                continue
            ckpt = os.path.join(out, name, f"checkpoint-{steps}")
            if name not in histories or not os.path.isdir(ckpt):
                histories[name], ckpt = train_draft(target, tokenizer, draft_data, os.path.join(out, name), s, steps,
                                                    anchor_offset=anchor, flash_noisy=noisy)
            checkpoints[name] = ckpt
            hist = histories[name]
            if name == "draft":
                record["draft"] = {"checkpoint": ckpt, "steps": steps, "probe_step_s": step_s,
                                   "tokens_seen": steps * s.draft_batch * s.draft_seq,
                                   "loss": _loss_summary(hist, s.log_every),
                                   "median_tokens_per_s": float(np.median([h["tokens_per_s"] for h in hist]))}
            lap(name)
        if ablations:
            record["ablations"] = {"checkpoints": checkpoints, **ablation_summary(
                {k: histories[k] for k in checkpoints}),
                "loss": {k: _loss_summary(histories[k], s.log_every) for k in checkpoints}}
        _write_json(record_path, record)
    return record


def export_pair(out: str, dest: str) -> dict:
    """Copy the recipe's target (bf16, with tokenizer) and main draft (cast to bf16) to ``dest/target`` and
    ``dest/draft``, with ``dest/pair.json`` (a summary of ``recipe.json``): the layout ``longspec.pretrained`` loads."""
    import shutil

    from safetensors.torch import load_file, save_file

    record = _read_json(os.path.join(out, "recipe.json"))
    if "draft" not in record:
        raise ValueError(f"{out} holds no trained draft: run the recipe's 'drafts' stage first")
    os.makedirs(dest, exist_ok=True)
    target_out = os.path.join(dest, "target")
    shutil.rmtree(target_out, ignore_errors=True)
    shutil.copytree(os.path.join(out, "target"), target_out)
    draft_out = os.path.join(dest, "draft")
    os.makedirs(draft_out, exist_ok=True)
    ckpt = record["draft"]["checkpoint"]
    config = _read_json(os.path.join(ckpt, "config.json"))
    _write_json(os.path.join(draft_out, "config.json"), {**config, "dtype": "bfloat16"})
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()},
              os.path.join(draft_out, "model.safetensors"), metadata={"format": "pt"})
    summary = {"scale": record["scale"]["name"], "device": record["device"], "torch": record["torch"],
               "corpus": record["corpus"], "heldout_frac": record["scale"]["heldout_frac"],
               "target": {k: record["target"][k] for k in ("params", "steps", "tokens_seen", "heldout_loss")}
               | {"final_loss": record["target"]["loss"]["last"]},
               "draft": {k: record["draft"][k] for k in ("steps", "tokens_seen")}
               | {"final_loss": record["draft"]["loss"]["last"]},
               "wall_s": record["wall_s"]}
    _write_json(os.path.join(dest, "pair.json"), summary)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--roots", nargs="*", default=None, help="package roots (default: stdlib + site-packages)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--ablations", action="store_true", help="also train drafts without anchor-offset / flash noisy")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--target-steps", type=int, default=None, help="fixed target steps (default: the scale's)")
    ap.add_argument("--draft-steps", type=int, default=None, help="fixed draft steps (default: the scale's)")
    ap.add_argument("--export", default=None, metavar="DEST", help="then copy the pair to DEST (bf16, shippable)")
    a = ap.parse_args(argv)
    record = run_recipe(a.out, a.scale, a.roots, a.device, ablations=a.ablations, stages=a.stages,
                        target_steps=a.target_steps, draft_steps=a.draft_steps)
    print(json.dumps({k: record.get(k) for k in ("corpus", "wall_s", "total_wall_s")}, indent=1))
    print(json.dumps({"target_loss": record.get("target", {}).get("loss", {}).get("last"),
                      "heldout_loss": record.get("target", {}).get("heldout_loss"),
                      "draft_loss": record.get("draft", {}).get("loss", {}).get("last")}))
    if a.export:
        print(json.dumps(export_pair(a.out, a.export)))


if __name__ == "__main__":
    main()
