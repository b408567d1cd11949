"""The code pair recipe's draft stage: the draft's data sample, its training runs and the ablations' summaries
(:mod:`longspec.recipes.code_pair`)."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from longspec.recipes.long_context import (block_sample, draft_heldout_loss, draft_heldout_metrics, draft_tau,
                                          steps_to_equal_loss, target_heldout_loss)
from longspec.recipes.pair_config import SEED, Scale, _loss_summary
from longspec.recipes.pair_data import _Recipe, _tokenizer
from longspec.recipes.pair_target import _load_target_fp32, budget_steps
from longspec.train.corpus import iter_records
from longspec.train.data import DataConfig
from longspec.train.trainer import TrainConfig, train

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
    anchor-offset reach (None: the target's max_position_embeddings), the draft to start from (None: fresh), the CE
    weight and the MLP units to widen the init draft to (None: as it is)."""

    seq: int
    batch: int
    lr: float
    kl_weight: float = 0.0
    max_positions: int | None = None
    init: str | None = None
    ce_weight: float = 1.0
    intermediate: int | None = None
    add_cross_blocks: int = 0


def scratch_draft_run(s: Scale) -> DraftRun:
    return DraftRun(s.draft_seq, s.draft_batch, s.draft_lr, s.draft_kl_weight)


def long_draft_run(s: Scale, init_draft: str | None) -> DraftRun:
    return DraftRun(s.long_draft_seq, s.long_draft_batch, s.long_draft_lr, s.long_draft_kl_weight, s.long_to_seq,
                    init_draft, s.long_draft_ce_weight, s.long_draft_intermediate, s.long_draft_add_cross_blocks)


def short_draft_run(s: Scale, long_mode: bool) -> DraftRun:
    return DraftRun(s.short_seq, s.short_batch, s.short_lr, 0.0, s.long_to_seq if long_mode else None)


def train_draft(target, tokenizer, data_jsonl: str, out_dir: str, s: Scale, steps: int, anchor_offset: bool = True,
                flash_noisy: bool = True, run: DraftRun | None = None, save_every: int | None = None
                ) -> tuple[list[dict], str]:
    from longspec.model.draft import LongSpecDraft

    run = run or scratch_draft_run(s)
    cfg = TrainConfig(data=DataConfig(paths=[data_jsonl], seq_len=run.seq), out_dir=out_dir, steps=steps,
                      batch_size=run.batch, lr=run.lr, anchor_offset=anchor_offset, flash_noisy=flash_noisy,
                      kl_weight=run.kl_weight, ce_weight=run.ce_weight, max_positions=run.max_positions,
                      loss_chunk=s.draft_loss_chunk,
                      save_every=save_every or steps, log_every=s.log_every, progress=False, seed=SEED)
    draft = None
    if run.intermediate is not None and run.init is None:
        raise ValueError(f"long_draft_intermediate ({run.intermediate}) widens a trained draft: it needs --init-draft")
    if run.add_cross_blocks and run.init is None:
        raise ValueError(f"long_draft_add_cross_blocks ({run.add_cross_blocks}) grows a trained draft: it needs "
                         "--init-draft")
    if run.init is not None and not os.path.isfile(os.path.join(out_dir, "latest")):  # a resume loads its own
        draft = LongSpecDraft.from_pretrained(run.init, target=target, dtype=torch.float32)
        if run.intermediate is not None and run.intermediate != draft.config.intermediate_size:
            from longspec.model.draft_grow import widen_mlp

            draft = widen_mlp(draft, run.intermediate, seed=SEED)
        if run.add_cross_blocks:
            from longspec.model.draft_grow import add_cross_blocks

            draft = add_cross_blocks(draft, run.add_cross_blocks, seed=SEED)
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


# Checkpoints of a draft run scored by held-out loss (stage drafts): the curve that shows whether it still falls.
CURVE_POINTS = 8


def checkpoint_curve(out_dir: str, final: str, target, held: np.ndarray, contexts, windows: int,
                     device: torch.device) -> tuple[list, list]:
    """``[[step, {context: held-out loss}], ...]`` for every ``checkpoint-*`` of a run in ``out_dir``, step
    ascending, and beside it, from the same pass, ``[[step, {context: {"kl": .., "top1": ..}}], ...]`` (the
    draft's match with the target: :func:`~longspec.recipes.long_context.draft_heldout_metrics`); every checkpoint
    but ``final`` is removed once scored."""
    from longspec.model.draft import LongSpecDraft
    from longspec.runs import checkpoint_step

    curve, match = [], []
    ckpts = sorted((d for d in os.listdir(out_dir) if d.startswith("checkpoint-")),
                   key=lambda d: checkpoint_step(Path(d)))
    for d in ckpts:
        draft = LongSpecDraft.from_pretrained(os.path.join(out_dir, d), target=target)
        metrics = draft_heldout_metrics(draft, target, held, contexts, windows, device)
        step = int(d.split("-")[1])
        curve.append([step, {str(k): m["ce"] for k, m in metrics.items()}])
        match.append([step, {str(k): {"kl": m["kl"], "top1": m["top1"]} for k, m in metrics.items()}])
        if os.path.join(out_dir, d) != final:
            shutil.rmtree(os.path.join(out_dir, d))
    return curve, match


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


def _stage_drafts(r: _Recipe, ablations: bool, draft_steps: int | None) -> None:
    s, record, dev = r.s, r.record, r.dev
    target, tokenizer = _load_target_fp32(r), _tokenizer(r)
    run = long_draft_run(s, r.init_draft) if r.long else scratch_draft_run(s)
    draft_data = os.path.join(r.corpus_dir, "draft.jsonl")
    steps, step_s = draft_steps or record.get("draft", {}).get("steps"), None
    if not os.path.isfile(draft_data):
        want = int((steps or s.draft_steps) * run.batch * run.seq * 3.5 * 1.2)
        if r.long or run.seq > s.target_seq:  # contiguous files: a long window is repository-level context
            block_sample(r.train_jsonl, draft_data, want, int(2 * run.seq * 3.5))
        else:
            stride_sample(r.train_jsonl, draft_data, want)
    if steps is None and s.draft_seconds is not None:
        step_s = probe_draft_step_s(target, tokenizer, draft_data, s, os.path.join(r.out, "draft_probe"), run=run)
        steps = budget_steps(s.draft_seconds, step_s, s.draft_steps)
    steps = steps or s.draft_steps
    held = r.held_tokens(tokenizer)
    contexts = [c for c in s.draft_eval_contexts if held is not None and c <= held.size]
    histories = record.setdefault("draft_histories", {})
    heldout = record.setdefault("draft_heldout_loss", {})
    curves = record.setdefault("draft_heldout_curves", {})
    if contexts and "target" not in heldout:  # the level each draft's loss is compared with, on the same windows
        heldout["target"] = {str(k): v for k, v in target_heldout_loss(target, held, contexts, s.short_eval_windows,
                                                                        dev).items()}
    checkpoints = {}
    for name, (anchor, noisy) in DRAFT_VARIANTS.items():
        if name != "draft" and not ablations:
            continue
        out_dir = os.path.join(r.out, name)
        ckpt = os.path.join(out_dir, f"checkpoint-{steps}")
        if name not in histories or not os.path.isdir(ckpt):
            histories[name], ckpt = train_draft(target, tokenizer, draft_data, out_dir, s, steps,
                                                anchor_offset=anchor, flash_noisy=noisy, run=run,
                                                save_every=max(1, steps // CURVE_POINTS) if contexts else None)
            heldout.pop(name, None)
            if contexts:  # the curve's last point is the final checkpoint's held-out loss
                curves[name], record.setdefault("draft_heldout_match", {})[name] = checkpoint_curve(
                    out_dir, ckpt, target, held, contexts, s.short_eval_windows, dev)
                heldout[name] = curves[name][-1][1]
        checkpoints[name] = ckpt
        if contexts and name not in heldout:
            from longspec.model.draft import LongSpecDraft

            draft = LongSpecDraft.from_pretrained(ckpt, target=target)
            heldout[name] = {str(k): v for k, v in draft_heldout_loss(
                draft, target, held, contexts, s.short_eval_windows, dev).items()}
        hist = histories[name]
        if name == "draft":
            record["draft"] = {"checkpoint": ckpt, "steps": steps, "probe_step_s": step_s,
                               "tokens_seen": steps * run.batch * run.seq, "run": asdict(run),
                               "loss": _loss_summary(hist, s.log_every),
                               "median_tokens_per_s": float(np.median([h["tokens_per_s"] for h in hist]))}
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
        curves[name], entry.setdefault("match", {})[name] = checkpoint_curve(out_dir, final, target, held, contexts,
                                                                            s.short_eval_windows, dev)
        entry.setdefault("train_loss", {})[name] = _loss_summary(history, s.log_every)
        draft = LongSpecDraft.from_pretrained(final, target=target)
        taus[name] = {str(k): v for k, v in draft_tau(target, draft, tokenizer, r.heldout_jsonl, contexts,
                                                       s.tau_prompts, s.tau_new_tokens).items()}
        entry.setdefault("checkpoints", {})[name] = final
        r.lap(name)
    entry["summary"] = {str(c): steps_to_equal_loss({k: [(st, l[str(c)]) for st, l in v] for k, v in curves.items()})
                        for c in contexts}
    r.save()
