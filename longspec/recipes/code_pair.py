"""The recipe for a real target/draft pair on Python code (issues 7 and 18): corpus -> tokenizer -> target ->
LongSpec draft, from scratch or continuing a trained target for long context.

Usage: ``python -m longspec.recipes.code_pair --out DIR [--scale tiny|h200] [--ablations] [--stages ...]
[--init-target DIR [--init-draft DIR]] [--set FIELD=VALUE ...]``

1. Corpus: the Python source installed on the machine (stdlib + site-packages), split by top-level package into
   ``DIR/corpus/train.jsonl`` and ``heldout.jsonl`` (:mod:`longspec.train.corpus`).
2. Tokenizer: byte-level BPE on the training split (``DIR/target``, next to the model); with ``--init-target``
   the init target's tokenizer, copied.
3. Target: a Llama-architecture model trained from scratch with plain AdamW + linear warm-up + cosine decay and
   gradient clipping, bf16 autocast on CUDA, on random windows of the pre-tokenised training split (a uint16
   memmap, so no tokenisation sits in the loop); saved in bfloat16 (the weights every later stage and the shipped
   pair use) with the tokenizer to ``DIR/target``. With ``--init-target DIR`` (long-context mode) the target is
   instead that trained model, continued on long windows (``long_windows``: 32k tokens, then 64k, at the h200
   scale) with its RoPE base rescaled for the longer context (:func:`~longspec.recipes.long_context.ntk_rope_theta`)
   and ``max_position_embeddings`` raised to twice the longest window (so a 64k prompt plus generation fits);
   ``recipe.json`` records its held-out loss at ``eval_contexts`` before and after.
4. Draft: the LongSpec draft trained with the project's trainer (``longspec.train.train``, anchor-offset and flash
   noisy on) against that bf16 target, on a sample of the training split that spans every package;
   ``DIR/draft/checkpoint-<steps>``. ``--ablations`` adds the same run without anchor-offset and without flash
   noisy (same steps, seed, data and initialisation). In long-context mode the drafts train on
   ``long_draft_seq``-token windows (the context the target now holds; blocks of consecutive files, so a window is
   repository-level context), with anchor-offset positions up to ``long_to_seq``, the KL term
   (``long_draft_kl_weight``) and, with ``--init-draft``, from that draft; each draft's held-out loss at
   ``draft_eval_contexts`` is recorded.
5. Stage ``short`` (the paper's regime for anchor-offset, arXiv 2502.17421 section 3.2): two fresh drafts trained
   on short windows (``short_seq`` <= 1.2k tokens), one with anchor-offset positions reaching ``long_to_seq``, one
   with plain positions; every ``1/short_evals`` of the run a checkpoint is scored by held-out loss at
   ``draft_eval_contexts`` (16k and 32k at h200), the final ones also by tau there; ``recipe.json`` gets the curves
   and the steps each variant needs to reach the loss both reach (the paper: anchor-offset 3.93x sooner).
6. ``DIR/recipe.json``: config, seeds, corpus sizes, losses (first / last / every ``log_every`` steps, and the
   target's held-out loss) and wall time per stage, updated after every stage.

Stages (``--stages data target drafts short``; the first three by default) skip work whose output exists, so the
recipe can run in several processes (or machines) over one ``DIR``: ``data`` writes the corpus, the tokenizer and
the token files; ``target`` needs the token file; ``drafts`` and ``short`` rebuild a missing corpus and held-out
token file but never retrain the tokenizer.

Step counts. At ``tiny`` they are fixed. At ``h200`` each training run gets a wall-clock budget: a short probe
times a few steps and the run takes ``budget / step time`` steps (capped), so the schedule is a plain fixed-step
cosine; the chosen counts are in ``recipe.json`` and ``--target-steps`` / ``--draft-steps`` replay them exactly
(``--target-steps`` counts the continuation's steps in long-context mode). ``--set FIELD=VALUE`` changes one
field of the scale (``--set long_seconds=200``, ``--set long_windows=32768x2:1``; ``none`` for no budget); the
changed scale is recorded, and a directory only resumes under the scale it was started with.

Scales. ``tiny``: seconds on a CPU (seq 256, a handful of steps): it tests the pipeline, not the model. ``h200``:
vocab 8192; target hidden 384, 8 layers, 6 heads / 2 KV heads (head dim 64), MLP 1024, tied embeddings (about
15.7M parameters, 31 MB in bf16, so that target + draft + tokenizer ship in under 40 MB), rope_theta 1e6,
max_position_embeddings 65536 (32k prompts plus generation fit); target seq 8192 x batch 8 for 300 s, of which the
last quarter of the steps train on 32k-token windows (batch 2); each draft seq 8192 x batch 4 for 120 s.
Long-context mode at h200 (from the shipped pair, trained on 8k windows): 230 s of continuation, three quarters of
the steps on 32k x 2 windows, then 64k x 1, peak LR 5e-4; RoPE base 1e6 -> 8.55e6 (NTK scaling for 8k -> 64k),
max_position_embeddings 131072; drafts on 32k x 1 windows with KL weight 1 for 120 s each; stage ``short`` 45 s
per variant on 1024 x 32 windows. (The shipped pair, ``benchmarks/results/h200/recipe.json``, predates the
long-window quarter and this mode: its target saw 8k windows only, and its tau falls beyond 8k.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from longspec.recipes.long_context import (Window, block_sample, draft_heldout_loss, draft_tau, file_sha256,
                                           ntk_rope_theta, parse_windows, phase_steps, random_windows,
                                           steps_to_equal_loss, window_tokens)
from longspec.train.corpus import build_corpus, iter_records
from longspec.train.data import DataConfig
from longspec.train.tokenizer import train_bpe_tokenizer
from longspec.train.trainer import TrainConfig, train, warmup_cosine

SEED = 0
SHIP_LIMIT_BYTES = 40 * 10**6  # the shipped pair (target + draft + tokenizer) stays under 40 MB


@dataclass(frozen=True)
class Scale:
    """Every knob of one recipe size. ``*_seconds`` set: the step count comes from a timed probe (capped by
    ``*_steps``); None: exactly ``*_steps`` steps. The ``long_*`` fields act only with an init target
    (``--init-target``); the ``short_*`` ones in stage ``short``."""

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
    # long-context mode (--init-target): continue a trained target, then its drafts at the new context
    long_from_seq: int  # the init target's training window (the RoPE base is rescaled from it ...)
    long_to_seq: int  # ... to this context: the longest window, and the drafts' anchor-offset reach
    long_windows: tuple[Window, ...]  # the continuation's phases: (seq, batch, share of the steps), in order
    long_steps: int
    long_seconds: float | None
    long_lr: float
    long_warmup_ratio: float
    long_draft_seq: int
    long_draft_batch: int
    long_draft_lr: float
    long_draft_kl_weight: float
    eval_contexts: tuple[int, ...]  # the target's held-out loss, before and after the continuation
    draft_eval_contexts: tuple[int, ...]  # drafts' held-out loss and (stage short) tau
    # stage short: the paper's anchor-offset regime
    short_seq: int
    short_batch: int
    short_steps: int
    short_seconds: float | None
    short_lr: float
    short_evals: int  # checkpoints scored per variant (evenly spaced; the last is the final one)
    short_eval_windows: int  # held-out windows per context and checkpoint
    tau_prompts: int
    tau_new_tokens: int


SCALES = {
    "tiny": Scale("tiny", corpus_max_chars=2_000_000, heldout_frac=0.1, vocab_size=512,
                  tokenizer_max_chars=1_000_000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                  tie_embeddings=True, max_positions=4096, rope_theta=500000.0, target_seq=256, target_batch=2,
                  target_long_seq=512, target_long_ratio=0.5,
                  target_steps=4, target_seconds=None, target_lr=3e-3, target_warmup_ratio=0.25, draft_seq=256,
                  draft_batch=2, draft_steps=3, draft_seconds=None, draft_lr=3e-3, log_every=1, eval_windows=2,
                  long_from_seq=256, long_to_seq=1024, long_windows=((512, 2, 0.5), (1024, 1, 0.5)), long_steps=3,
                  long_seconds=None, long_lr=1e-3, long_warmup_ratio=0.25, long_draft_seq=512, long_draft_batch=1,
                  long_draft_lr=1e-3, long_draft_kl_weight=1.0, eval_contexts=(256, 1024),
                  draft_eval_contexts=(512, 1024), short_seq=128, short_batch=2, short_steps=4,
                  short_seconds=None, short_lr=3e-3, short_evals=2, short_eval_windows=1, tau_prompts=1,
                  tau_new_tokens=6),
    "h200": Scale("h200", corpus_max_chars=None, heldout_frac=0.1, vocab_size=8192,
                  tokenizer_max_chars=100_000_000, hidden=384, intermediate=1024, layers=8, heads=6, kv_heads=2,
                  tie_embeddings=True, max_positions=65536, rope_theta=1_000_000.0, target_seq=8192,
                  target_batch=8, target_long_seq=32768, target_long_ratio=0.25, target_steps=4000,
                  target_seconds=300.0, target_lr=2e-3, target_warmup_ratio=0.05,
                  draft_seq=8192, draft_batch=4, draft_steps=3000, draft_seconds=120.0, draft_lr=1e-3,
                  log_every=20, eval_windows=16,
                  long_from_seq=8192, long_to_seq=65536, long_windows=((32768, 2, 0.75), (65536, 1, 0.25)),
                  long_steps=4000, long_seconds=230.0, long_lr=5e-4, long_warmup_ratio=0.05, long_draft_seq=32768,
                  long_draft_batch=1, long_draft_lr=5e-4, long_draft_kl_weight=1.0,
                  eval_contexts=(8192, 32768, 65536), draft_eval_contexts=(16384, 32768), short_seq=1024,
                  short_batch=32, short_steps=4000, short_seconds=45.0, short_lr=1e-3, short_evals=12,
                  short_eval_windows=4, tau_prompts=2, tau_new_tokens=128),
}
STAGES = ("data", "target", "drafts", "short")
DEFAULT_STAGES = ("data", "target", "drafts")


def scale_with(s: Scale, assignments: Sequence[str]) -> Scale:
    """``s`` with ``FIELD=VALUE`` assignments applied (``--set``): numbers, ``none`` for an optional budget,
    ``long_windows`` as ``SEQxBATCH:SHARE,...`` and the context tuples as ``N,N,...``."""
    fields = {f.name: f for f in dataclasses.fields(Scale)}
    changes = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep or name not in fields or name == "name":
            raise ValueError(f"--set: expected FIELD=VALUE with FIELD a scale field other than name "
                             f"({', '.join(n for n in fields if n != 'name')}), got {item!r}")
        current = getattr(s, name)
        try:
            if name == "long_windows":
                value = parse_windows(text)
            elif isinstance(current, tuple):
                value = tuple(int(x) for x in text.split(","))
            elif text.lower() == "none" and "None" in str(fields[name].type):
                value = None
            elif isinstance(current, bool):
                value = {"true": True, "false": False}[text.lower()]
            elif isinstance(current, int) or (current is None and "int" in str(fields[name].type)):
                value = int(text)
            elif isinstance(current, float) or current is None:
                value = float(text)
            else:
                raise ValueError
        except (ValueError, KeyError) as err:
            detail = f": {err}" if isinstance(err, ValueError) and str(err) else ""
            raise ValueError(f"--set {item!r}: not a valid value for {name} (now {current!r}){detail}") from None
        changes[name] = value
    return dataclasses.replace(s, **changes)


def _jsonable(obj):
    return json.loads(json.dumps(obj))


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


def heldout_chars(s: Scale, long_mode: bool) -> int:
    """Characters of the held-out split to pre-tokenise for evaluation: enough for the longest evaluated window
    (about 4 characters per token, 4 windows' worth) in long-context mode."""
    base = s.eval_windows * s.target_seq * 8
    return max(base, 16 * max(s.eval_contexts + s.draft_eval_contexts)) if long_mode else base


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


def init_target_info(init_dir: str) -> dict:
    """What the recipe needs to know of an init target directory (checked): RoPE base, head dim, positions and a
    hash of its weights (a resumed recipe must continue the same model)."""
    from transformers import AutoConfig

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not os.path.isfile(os.path.join(init_dir, name)):
            raise ValueError(f"--init-target {init_dir!r} has no {name}: give a trained target directory with its "
                             "tokenizer (e.g. longspec/assets/code-pair/target)")
    config = AutoConfig.from_pretrained(init_dir)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        raise ValueError(f"--init-target {init_dir!r} uses RoPE {rope}; the recipe rescales only plain (default) "
                         "RoPE")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"dir": os.path.abspath(init_dir), "sha256": file_sha256(os.path.join(init_dir, "model.safetensors")),
            "rope_theta": float(rope["rope_theta"]), "head_dim": int(head_dim),
            "max_position_embeddings": int(config.max_position_embeddings)}


def load_init_target(init_dir: str, rope_theta: float, max_positions: int, dtype: torch.dtype = torch.float32):
    """The init target with its RoPE base set to ``rope_theta`` and ``max_position_embeddings`` to
    ``max_positions``. The config is changed before the model is built: the rotary module computes its frequencies
    from the config at construction, so changing the config of a built model would not change them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(init_dir)
    config.rope_parameters = {**dict(config.rope_parameters), "rope_theta": float(rope_theta)}
    config.max_position_embeddings = int(max_positions)
    return AutoModelForCausalLM.from_pretrained(init_dir, config=config, dtype=dtype, attn_implementation="sdpa")


@dataclass(frozen=True)
class TargetRun:
    """One target training run's schedule: window phases, peak LR and warm-up share."""

    windows: tuple[Window, ...]
    lr: float
    warmup_ratio: float


def long_window(s: Scale) -> tuple[int, int]:
    """(seq, batch) of the from-scratch run's long-window steps: about the tokens of a normal step."""
    return s.target_long_seq, max(1, s.target_batch * s.target_seq // s.target_long_seq)


def scratch_run(s: Scale) -> TargetRun:
    seq, batch = long_window(s)
    return TargetRun(((s.target_seq, s.target_batch, 1 - s.target_long_ratio), (seq, batch, s.target_long_ratio)),
                     s.target_lr, s.target_warmup_ratio)


def continuation_run(s: Scale) -> TargetRun:
    return TargetRun(tuple(s.long_windows), s.long_lr, s.long_warmup_ratio)


class _TargetTrainer:
    """One AdamW + warm-up/cosine run over ``steps`` steps: clip 1.0, bf16 autocast on CUDA (fp32 master weights)."""

    def __init__(self, model, tokens: np.ndarray, run: TargetRun, steps: int, device: torch.device):
        self.model, self.tokens, self.run, self.device = model.to(device).train(), tokens, run, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, warmup_cosine(max(1, int(run.warmup_ratio * steps)), steps))
        self.gen = torch.Generator().manual_seed(SEED + 1)
        self.ends = np.cumsum(phase_steps(run.windows, steps))  # step k (1-based) is in the first phase ending >= k
        self.done = 0

    def step(self, phase: int | None = None):
        """One step; ``phase`` forces the window phase (the probe times each), default: by the schedule."""
        self.done += 1
        if phase is None:
            phase = min(int(np.searchsorted(self.ends, self.done)), len(self.run.windows) - 1)
        seq, batch, _ = self.run.windows[phase]
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


def probe_target_step_s(make_model: Callable[[], torch.nn.Module], tokens: np.ndarray, run: TargetRun,
                        device: torch.device, warm: int = 2, timed: int = 4) -> float:
    """Mean seconds per target training step over the schedule (each window phase timed, weighted by its share),
    timed on a throwaway model from ``make_model`` (the real run starts from its own fresh copy)."""
    trainer = _TargetTrainer(make_model(), tokens, run, len(run.windows) * (warm + timed), device)
    mean = 0.0
    for phase, (_, _, share) in enumerate(run.windows):
        if share <= 0:
            continue
        for _ in range(warm):
            trainer.step(phase)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(timed):
            trainer.step(phase)
        _sync(device)
        mean += share * (time.perf_counter() - t0) / timed
    return mean


def _target_tokens(s: Scale, steps: int) -> int:
    return window_tokens(scratch_run(s).windows, steps)


def budget_steps(seconds: float, step_s: float, cap: int) -> int:
    return max(1, min(cap, int(seconds / step_s)))


def train_target(model, tokens: np.ndarray, s: Scale, steps: int, device: torch.device,
                 run: TargetRun | None = None) -> list[dict]:
    """Train ``model`` for ``steps`` steps of ``run`` (default: the scale's from-scratch schedule); returns the log
    rows (only logged steps sync the device)."""
    trainer = _TargetTrainer(model, tokens, run or scratch_run(s), steps, device)
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


def eval_by_context(model, tokens: np.ndarray, s: Scale, device: torch.device) -> dict[str, float]:
    """Held-out loss at each of ``s.eval_contexts`` (``{"8192": loss, ...}``; contexts longer than the held-out
    sample are skipped)."""
    windows = max(1, s.eval_windows // 4)
    return {str(c): eval_loss(model, tokens, s, device, c, windows) for c in s.eval_contexts if c <= tokens.size}


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
# Stage short: the paper's regime, anchor-offset positions against plain ones (flash noisy on in both).
SHORT_VARIANTS = {"short_anchor": True, "short_plain": False}


@dataclass(frozen=True)
class DraftRun:
    """One draft training run's settings (besides the ablation switches): windows, LR, KL weight, the
    anchor-offset reach (None: the target's max_position_embeddings) and the draft to start from (None: fresh)."""

    seq: int
    batch: int
    lr: float
    kl_weight: float = 0.0
    max_positions: int | None = None
    init: str | None = None


def scratch_draft_run(s: Scale) -> DraftRun:
    return DraftRun(s.draft_seq, s.draft_batch, s.draft_lr)


def long_draft_run(s: Scale, init_draft: str | None) -> DraftRun:
    return DraftRun(s.long_draft_seq, s.long_draft_batch, s.long_draft_lr, s.long_draft_kl_weight, s.long_to_seq,
                    init_draft)


def short_draft_run(s: Scale, long_mode: bool) -> DraftRun:
    return DraftRun(s.short_seq, s.short_batch, s.short_lr, 0.0, s.long_to_seq if long_mode else None)


def train_draft(target, tokenizer, data_jsonl: str, out_dir: str, s: Scale, steps: int, anchor_offset: bool = True,
                flash_noisy: bool = True, run: DraftRun | None = None, save_every: int | None = None
                ) -> tuple[list[dict], str]:
    from longspec.model.draft import LongSpecDraft

    run = run or scratch_draft_run(s)
    cfg = TrainConfig(data=DataConfig(paths=[data_jsonl], seq_len=run.seq), out_dir=out_dir, steps=steps,
                      batch_size=run.batch, lr=run.lr, anchor_offset=anchor_offset, flash_noisy=flash_noisy,
                      kl_weight=run.kl_weight, max_positions=run.max_positions, save_every=save_every or steps,
                      log_every=s.log_every, progress=False, seed=SEED)
    draft = None
    if run.init is not None and not os.path.isfile(os.path.join(out_dir, "latest")):  # a resume loads its own
        draft = LongSpecDraft.from_pretrained(run.init, target=target, dtype=torch.float32)
    history = train(cfg, target, tokenizer, draft=draft)
    return history, os.path.join(out_dir, f"checkpoint-{steps}")


def probe_draft_step_s(target, tokenizer, data_jsonl: str, s: Scale, tmp_dir: str, steps: int = 8,
                       run: DraftRun | None = None) -> float:
    """Seconds per draft training step: the median of a short run's later steps (into a scratch directory)."""
    run = run or scratch_draft_run(s)
    history, _ = train_draft(target, tokenizer, data_jsonl, tmp_dir, s, steps, run=run)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tokens = run.batch * run.seq
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


class _Recipe:
    """The state one :func:`run_recipe` call shares between its stages."""

    def __init__(self, out: str, s: Scale, roots, dev: torch.device, init_target: str | None,
                 init_draft: str | None):
        self.out, self.s, self.roots, self.dev = out, s, roots, dev
        self.init_target, self.init_draft = init_target, init_draft
        self.long = init_target is not None
        self.corpus_dir, self.target_dir = os.path.join(out, "corpus"), os.path.join(out, "target")
        self.train_jsonl = os.path.join(self.corpus_dir, "train.jsonl")
        self.heldout_jsonl = os.path.join(self.corpus_dir, "heldout.jsonl")
        self.tokens_file = os.path.join(self.corpus_dir, "train.u16")
        self.held_file = os.path.join(self.corpus_dir, "heldout.u16")
        self.record_path = os.path.join(out, "recipe.json")
        self.record = _read_json(self.record_path)
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        times = self.record.setdefault("wall_s", {})
        times[name] = round(now - self.t, 3)
        self.t = now
        self.record["total_wall_s"] = round(sum(times.values()), 3)
        self.save()

    def save(self) -> None:
        _write_json(self.record_path, self.record)

    def held_tokens(self, tokenizer) -> np.ndarray | None:
        """The held-out token sample (rebuilt when missing, e.g. on a fresh machine); None when it is empty."""
        if not os.path.isfile(self.held_file):
            n = pretokenize(self.heldout_jsonl, tokenizer, self.held_file, max_chars=heldout_chars(self.s, self.long))
            self.record.setdefault("corpus", {})["heldout_tokens_sampled"] = n
        # np.memmap refuses empty files; a tiny corpus may hold out nothing.
        return np.memmap(self.held_file, dtype=np.uint16, mode="r") if os.path.getsize(self.held_file) > 2 else None


def run_recipe(out: str, scale: str | Scale = "tiny", roots: Sequence[str] | None = None,
               device: str | torch.device | None = None, ablations: bool = False,
               stages: Sequence[str] = DEFAULT_STAGES, target_steps: int | None = None,
               draft_steps: int | None = None, init_target: str | None = None,
               init_draft: str | None = None) -> dict:
    """Run ``stages`` into ``out`` (skipping work already there) and return (and write) the ``recipe.json`` record.

    target_steps / draft_steps override the scale's step counts and budgets (to replay a recorded run).
    init_target (a trained target directory with its tokenizer) switches to long-context mode: the target stage
    continues it instead of training one (module docstring); init_draft starts the drafts from a trained draft.
    """
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages must be among {STAGES}, got {sorted(unknown)}")
    if init_draft is not None and init_target is None:
        raise ValueError("--init-draft needs --init-target (a draft is trained for one target)")
    if init_draft is not None and not os.path.isfile(os.path.join(init_draft, "config.json")):
        raise ValueError(f"--init-draft {init_draft!r} is not a draft checkpoint directory (no config.json)")
    s = SCALES[scale] if isinstance(scale, str) else scale
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(out, exist_ok=True)
    r = _Recipe(out, s, roots, dev, init_target, init_draft)
    record = r.record
    recorded = record.get("scale", _jsonable(asdict(s)))
    if recorded != _jsonable(asdict(s)):
        differ = sorted(k for k, v in _jsonable(asdict(s)).items() if recorded.get(k) != v)
        raise ValueError(f"{out} holds a recipe of another scale ({recorded.get('name')}; fields that differ: "
                         f"{', '.join(differ)}); use a fresh --out")
    if r.long:
        info = init_target_info(init_target)
        if s.long_from_seq >= s.long_to_seq or max(w[0] for w in s.long_windows) > s.long_to_seq:
            raise ValueError(f"scale {s.name}: long_from_seq ({s.long_from_seq}) must be below long_to_seq "
                             f"({s.long_to_seq}), and no long window may exceed it")
        seen = record.get("init", {}).get("target")
        if seen is not None and seen["sha256"] != info["sha256"]:
            raise ValueError(f"{out} continues another init target ({seen['dir']}); use a fresh --out")
        if seen is None and "target" in record:
            raise ValueError(f"{out} holds a target trained from scratch; use a fresh --out for --init-target")
        record.setdefault("init", {})["target"] = {**info, **{k: v for k, v in (seen or {}).items()
                                                              if k == "heldout_loss"}}
        if init_draft is not None:
            record["init"]["draft"] = {"dir": os.path.abspath(init_draft),
                                       "sha256": file_sha256(os.path.join(init_draft, "model.safetensors"))}
    elif "init" in record:
        raise ValueError(f"{out} holds a long-context recipe (init target {record['init']['target']['dir']}); "
                         "pass the same --init-target")
    record.update(scale=_jsonable(asdict(s)), seeds={"torch": SEED, "target_windows": SEED + 1,
                                                     "eval_windows": SEED + 2, "draft": SEED},
                  device=str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev), torch=torch.__version__)

    _stage_data(r, stages)
    if "target" in stages and "target" not in record:
        _stage_target(r, target_steps)
    if "drafts" in stages:
        _stage_drafts(r, ablations, draft_steps)
    if "short" in stages:
        _stage_short(r)
    r.save()
    return record


def _tokenizer(r: _Recipe):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(r.target_dir)


def _stage_data(r: _Recipe, stages: Sequence[str]) -> None:
    """The corpus (whenever a stage needs it and it is missing), the tokenizer and the token files (stage data)."""
    s, record = r.s, r.record
    corpus_stats = os.path.join(r.corpus_dir, "stats.json")
    if not os.path.isfile(corpus_stats) and set(stages) & {"data", "drafts", "short"}:
        corpus = build_corpus(r.corpus_dir, roots=r.roots, heldout_frac=s.heldout_frac, max_chars=s.corpus_max_chars)
        stats = {"packages": corpus.packages, "files": corpus.files, "chars": corpus.chars,
                 "skipped_files": corpus.skipped_files}
        seen = {k: record["corpus"][k] for k in stats if k in record.get("corpus", {})}
        if seen and seen != {k: stats[k] for k in seen}:
            raise ValueError(f"the rebuilt corpus {stats} differs from the recorded one {seen} (other packages?)")
        _write_json(corpus_stats, stats)
        record["corpus"] = {**record.get("corpus", {}), **stats}
        r.lap("corpus")
    if "data" in stages and not os.path.isfile(os.path.join(r.target_dir, "tokenizer.json")):
        if r.long:  # the init target's own tokenizer: its embeddings are indexed by it
            os.makedirs(r.target_dir, exist_ok=True)
            for name in os.listdir(r.init_target):
                if name.startswith(("tokenizer", "special_tokens")):
                    shutil.copy2(os.path.join(r.init_target, name), r.target_dir)
        else:
            train_bpe_tokenizer([r.train_jsonl], s.vocab_size, r.target_dir, max_chars=s.tokenizer_max_chars)
        r.lap("tokenizer")
    if "data" in stages and "train_tokens" not in record.get("corpus", {}):
        tokenizer = _tokenizer(r)
        record["corpus"]["train_tokens"] = pretokenize(r.train_jsonl, tokenizer, r.tokens_file)
        record["corpus"]["heldout_tokens_sampled"] = pretokenize(r.heldout_jsonl, tokenizer, r.held_file,
                                                                 max_chars=heldout_chars(s, r.long))
        r.lap("pretokenize")


def _stage_target(r: _Recipe, target_steps: int | None) -> None:
    s, record, dev = r.s, r.record, r.dev
    if not os.path.isfile(r.tokens_file):
        raise ValueError(f"stage 'target' needs the token file {r.tokens_file}: run stage 'data' into {r.out} first")
    tokenizer = _tokenizer(r)
    train_tokens = np.memmap(r.tokens_file, dtype=np.uint16, mode="r")
    held = r.held_tokens(tokenizer)
    if r.long:
        init = record["init"]["target"]
        theta = ntk_rope_theta(init["rope_theta"], s.long_from_seq, s.long_to_seq, init["head_dim"])
        max_pos = 2 * s.long_to_seq
        run = continuation_run(s)
        if held is not None and "heldout_loss" not in init:  # the init target as shipped (bf16), before
            before = load_init_target(r.init_target, init["rope_theta"], init["max_position_embeddings"],
                                      torch.bfloat16).to(dev)
            init["heldout_loss"] = eval_by_context(before, held, s, dev)
            del before
            r.save()

        def make_model():
            return load_init_target(r.init_target, theta, max_pos)

        seconds, cap = s.long_seconds, s.long_steps
    else:
        run, theta, max_pos = scratch_run(s), None, None

        def make_model():
            return build_target(s, tokenizer)

        seconds, cap = s.target_seconds, s.target_steps
    steps, step_s = target_steps, None
    if steps is None and seconds is not None:
        step_s = probe_target_step_s(make_model, train_tokens, run, dev)
        steps = budget_steps(seconds, step_s, cap)
    steps = steps or cap
    target = make_model()
    history = train_target(target, train_tokens, s, steps, dev, run)
    # Every later stage, the benchmarks and the shipped pair use the bf16-rounded weights: evaluate those.
    target = target.to(torch.bfloat16).eval()
    entry = {"dir": r.target_dir, "params": sum(p.numel() for p in target.parameters()), "steps": steps,
             "probe_step_s": step_s, "saved_dtype": "bfloat16", "tokens_seen": window_tokens(run.windows, steps),
             "loss": _loss_summary(history, s.log_every),
             "heldout_loss": eval_loss(target, held, s, dev) if held is not None else None}
    if r.long:
        entry.update(init_from=record["init"]["target"]["dir"], windows=[list(w) for w in run.windows],
                     steps_per_window=phase_steps(run.windows, steps), lr=run.lr,
                     rope_theta={"from": record["init"]["target"]["rope_theta"], "to": theta,
                                 "rule": f"NTK: theta * ({s.long_to_seq}/{s.long_from_seq}) ** (d / (d - 2)), "
                                         f"d = head_dim {record['init']['target']['head_dim']}"},
                     max_position_embeddings=max_pos,
                     heldout_loss_by_context=eval_by_context(target, held, s, dev) if held is not None else None)
    else:
        entry["heldout_loss_long"] = (eval_loss(target, held, s, dev, s.target_long_seq, max(1, s.eval_windows // 4))
                                      if held is not None else None)
    record["target"] = entry
    target.save_pretrained(r.target_dir)
    tokenizer.save_pretrained(r.target_dir)
    del target
    r.lap("target")


def _load_target_fp32(r: _Recipe):
    """float32 copies of the bf16 weights: fp32 master weights for the drafts, bf16 autocast in the trainer."""
    from transformers import AutoModelForCausalLM

    if "target" not in r.record:
        raise ValueError(f"stages 'drafts' and 'short' need the target: run stage 'target' into {r.out} first")
    return AutoModelForCausalLM.from_pretrained(r.target_dir, dtype=torch.float32).to(r.dev).eval()


def _stage_drafts(r: _Recipe, ablations: bool, draft_steps: int | None) -> None:
    s, record, dev = r.s, r.record, r.dev
    target, tokenizer = _load_target_fp32(r), _tokenizer(r)
    run = long_draft_run(s, r.init_draft) if r.long else scratch_draft_run(s)
    draft_data = os.path.join(r.corpus_dir, "draft.jsonl")
    steps, step_s = draft_steps or record.get("draft", {}).get("steps"), None
    if not os.path.isfile(draft_data):
        want = int((steps or s.draft_steps) * run.batch * run.seq * 3.5 * 1.2)
        if r.long:  # contiguous files: a long window is repository-level context
            block_sample(r.train_jsonl, draft_data, want, int(2 * run.seq * 3.5))
        else:
            stride_sample(r.train_jsonl, draft_data, want)
    if steps is None and s.draft_seconds is not None:
        step_s = probe_draft_step_s(target, tokenizer, draft_data, s, os.path.join(r.out, "draft_probe"), run=run)
        steps = budget_steps(s.draft_seconds, step_s, s.draft_steps)
    steps = steps or s.draft_steps
    held = r.held_tokens(tokenizer) if r.long else None
    histories = record.setdefault("draft_histories", {})
    heldout = record.setdefault("draft_heldout_loss", {}) if r.long else {}
    checkpoints = {}
    for name, (anchor, noisy) in DRAFT_VARIANTS.items():
        if name != "draft" and not ablations:
            continue
        ckpt = os.path.join(r.out, name, f"checkpoint-{steps}")
        if name not in histories or not os.path.isdir(ckpt):
            histories[name], ckpt = train_draft(target, tokenizer, draft_data, os.path.join(r.out, name), s, steps,
                                                anchor_offset=anchor, flash_noisy=noisy, run=run)
            heldout.pop(name, None)
        checkpoints[name] = ckpt
        if held is not None and name not in heldout:
            from longspec.model.draft import LongSpecDraft

            draft = LongSpecDraft.from_pretrained(ckpt, target=target)
            heldout[name] = {str(k): v for k, v in draft_heldout_loss(
                draft, target, held, s.draft_eval_contexts, s.short_eval_windows, dev).items()}
        hist = histories[name]
        if name == "draft":
            record["draft"] = {"checkpoint": ckpt, "steps": steps, "probe_step_s": step_s,
                               "tokens_seen": steps * run.batch * run.seq, "run": asdict(run),
                               "loss": _loss_summary(hist, s.log_every),
                               "median_tokens_per_s": float(np.median([h["tokens_per_s"] for h in hist]))}
            if r.long:
                record["draft"]["heldout_loss"] = heldout.get(name)
        r.lap(name)
    if ablations:
        record["ablations"] = {"checkpoints": checkpoints, **ablation_summary(
            {k: histories[k] for k in checkpoints}),
            "loss": {k: _loss_summary(histories[k], s.log_every) for k in checkpoints}}
        if r.long:
            record["ablations"]["heldout_loss"] = {k: heldout[k] for k in checkpoints if k in heldout}
    r.save()


def _stage_short(r: _Recipe) -> None:
    """The paper's regime: fresh drafts on short windows, anchor-offset vs plain positions, scored at long context
    every ``1/short_evals`` of the run (``record["short_ablation"]``)."""
    from longspec.model.draft import LongSpecDraft
    from longspec.runs import checkpoint_step

    s, record, dev = r.s, r.record, r.dev
    if s.short_seq > 1200:
        raise ValueError(f"short_seq ({s.short_seq}) must be <= 1200: the paper applies anchor-offset to windows of "
                         "at most 1200 tokens")
    target, tokenizer = _load_target_fp32(r), _tokenizer(r)
    held = r.held_tokens(tokenizer)
    if held is None:
        raise ValueError(f"stage 'short' needs held-out tokens; {r.heldout_jsonl} is empty")
    contexts = [c for c in s.draft_eval_contexts if c <= held.size]
    if not contexts:
        raise ValueError(f"the held-out sample ({held.size} tokens) is shorter than every draft_eval_context "
                         f"{s.draft_eval_contexts}")
    run = short_draft_run(s, r.long)
    entry = record.setdefault("short_ablation", {})
    data = os.path.join(r.corpus_dir, "short.jsonl")
    steps = entry.get("steps")
    if not os.path.isfile(data):
        stride_sample(r.train_jsonl, data, int((steps or s.short_steps) * run.batch * run.seq * 3.5 * 1.2))
    step_s = entry.get("probe_step_s")
    if steps is None:
        if s.short_seconds is not None:
            step_s = probe_draft_step_s(target, tokenizer, data, s, os.path.join(r.out, "short_probe"), run=run)
            steps = budget_steps(s.short_seconds, step_s, s.short_steps)
        steps = steps or s.short_steps
    every = max(1, steps // s.short_evals)
    entry.update(steps=steps, probe_step_s=step_s, run=asdict(run), eval_every=every, eval_contexts=contexts,
                 eval_windows=s.short_eval_windows, anchor_reach=run.max_positions or target.config.max_position_embeddings)
    curves, taus = entry.setdefault("curves", {}), entry.setdefault("tau", {})
    for name, anchor in SHORT_VARIANTS.items():
        out_dir = os.path.join(r.out, name)
        final = os.path.join(out_dir, f"checkpoint-{steps}")
        if name in curves and os.path.isdir(final):
            continue
        history, final = train_draft(target, tokenizer, data, out_dir, s, steps, anchor_offset=anchor,
                                     flash_noisy=True, run=run, save_every=every)
        curve = []
        ckpts = sorted((d for d in os.listdir(out_dir) if d.startswith("checkpoint-")),
                       key=lambda d: checkpoint_step(Path(d)))
        for d in ckpts:
            draft = LongSpecDraft.from_pretrained(os.path.join(out_dir, d), target=target)
            losses = draft_heldout_loss(draft, target, held, contexts, s.short_eval_windows, dev)
            curve.append([int(d.split("-")[1]), {str(k): v for k, v in losses.items()}])
            if os.path.join(out_dir, d) != final:
                shutil.rmtree(os.path.join(out_dir, d))
        curves[name] = curve
        entry.setdefault("train_loss", {})[name] = _loss_summary(history, s.log_every)
        draft = LongSpecDraft.from_pretrained(final, target=target)
        taus[name] = {str(k): v for k, v in draft_tau(target, draft, tokenizer, r.heldout_jsonl, contexts,
                                                       s.tau_prompts, s.tau_new_tokens).items()}
        entry.setdefault("checkpoints", {})[name] = final
        r.lap(name)
    entry["summary"] = {str(c): steps_to_equal_loss({k: [(st, l[str(c)]) for st, l in v] for k, v in curves.items()})
                        for c in contexts}
    r.save()


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def export_pair(out: str, dest: str, limit_bytes: int = SHIP_LIMIT_BYTES) -> dict:
    """Copy the recipe's target (bf16, with tokenizer) and main draft (cast to bf16) to ``dest/target`` and
    ``dest/draft``, with ``dest/pair.json`` (a summary of ``recipe.json``): the layout ``longspec.pretrained`` loads.
    Raises ValueError when the pair would exceed ``limit_bytes`` (the shipped files stay under 40 MB)."""
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
    for name in ("draft_vocab.json",):
        if os.path.isfile(os.path.join(ckpt, name)):
            shutil.copy2(os.path.join(ckpt, name), draft_out)
    summary = {"scale": record["scale"]["name"], "device": record["device"], "torch": record["torch"],
               "corpus": record["corpus"], "heldout_frac": record["scale"]["heldout_frac"],
               "target": {k: record["target"][k] for k in ("params", "steps", "tokens_seen", "heldout_loss")}
               | {"final_loss": record["target"]["loss"]["last"]},
               "draft": {k: record["draft"][k] for k in ("steps", "tokens_seen")}
               | {"final_loss": record["draft"]["loss"]["last"]},
               "wall_s": record["wall_s"]}
    if "init" in record:  # long-context mode: what it continued and what it changed
        summary["init"] = {k: {"dir": v["dir"], "sha256": v["sha256"]} for k, v in record["init"].items()}
        summary["target"] |= {k: record["target"][k] for k in ("rope_theta", "max_position_embeddings", "windows",
                                                                "steps_per_window", "heldout_loss_by_context")}
        summary["target"]["heldout_loss_by_context_before"] = record["init"]["target"].get("heldout_loss")
        summary["draft"] |= {"run": record["draft"]["run"], "heldout_loss": record["draft"].get("heldout_loss")}
    _write_json(os.path.join(dest, "pair.json"), summary)
    size = _tree_bytes(target_out) + _tree_bytes(draft_out) + os.path.getsize(os.path.join(dest, "pair.json"))
    if size > limit_bytes:
        raise ValueError(f"the exported pair in {dest} is {size / 1e6:.1f} MB, over the {limit_bytes / 1e6:.0f} MB "
                         "the package ships")
    summary["bytes"] = size
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--roots", nargs="*", default=None, help="package roots (default: stdlib + site-packages)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--ablations", action="store_true", help="also train drafts without anchor-offset / flash noisy")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(DEFAULT_STAGES))
    ap.add_argument("--target-steps", type=int, default=None, help="fixed target steps (default: the scale's)")
    ap.add_argument("--draft-steps", type=int, default=None, help="fixed draft steps (default: the scale's)")
    ap.add_argument("--init-target", default=None, metavar="DIR",
                    help="continue this trained target (with its tokenizer) for long context instead of training one")
    ap.add_argument("--init-draft", default=None, metavar="DIR", help="start the drafts from this trained draft")
    ap.add_argument("--set", dest="assignments", action="append", default=[], metavar="FIELD=VALUE",
                    help="change one field of the scale (repeatable), e.g. long_seconds=200")
    ap.add_argument("--export", default=None, metavar="DEST", help="then copy the pair to DEST (bf16, shippable)")
    a = ap.parse_args(argv)
    for flag, value in (("--target-steps", a.target_steps), ("--draft-steps", a.draft_steps)):
        if value is not None and value < 1:
            ap.error(f"argument {flag}: must be >= 1, got {value}")
    for flag, value in (("--init-target", a.init_target), ("--init-draft", a.init_draft)):
        if value is not None and not os.path.isdir(value):
            ap.error(f"argument {flag}: {value!r} is not a directory")
    try:
        scale = scale_with(SCALES[a.scale], a.assignments)
        record = run_recipe(a.out, scale, a.roots, a.device, ablations=a.ablations, stages=a.stages,
                            target_steps=a.target_steps, draft_steps=a.draft_steps, init_target=a.init_target,
                            init_draft=a.init_draft)
    except ValueError as err:
        ap.exit(2, f"{ap.prog}: error: {err}\n")
    print(json.dumps({k: record.get(k) for k in ("corpus", "wall_s", "total_wall_s")}, indent=1))
    print(json.dumps({"target_loss": record.get("target", {}).get("loss", {}).get("last"),
                      "heldout_loss": record.get("target", {}).get("heldout_loss"),
                      "heldout_loss_by_context": record.get("target", {}).get("heldout_loss_by_context"),
                      "draft_loss": record.get("draft", {}).get("loss", {}).get("last"),
                      "draft_heldout_loss": record.get("draft_heldout_loss"),
                      "short_ablation": record.get("short_ablation", {}).get("summary")}))
    if a.export:
        print(json.dumps(export_pair(a.out, a.export)))


if __name__ == "__main__":
    main()
