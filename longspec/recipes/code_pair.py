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
   ``draft_eval_contexts`` is recorded. Every draft run is checkpointed ``CURVE_POINTS`` times and each checkpoint
   scored by held-out loss at ``draft_eval_contexts`` (``recipe.json``: ``draft_heldout_curves``, beside the
   target's loss on the same windows, ``draft_heldout_loss["target"]``; and, from the same pass,
   ``draft_heldout_match``: KL to the target and the share of positions whose top-1 token is the target's), so the
   record shows whether the loss still falls; from scratch, windows longer than the target's are block samples too,
   and ``draft_kl_weight`` adds the KL term.
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
field of the scale (``--set long_seconds=200``, ``--set long_windows=32768x2:1``; ``none`` for no budget;
``long_from_seq`` equal to ``long_to_seq`` continues a target already trained for that context at its own RoPE
base, e.g. the h200-deep target; ``long_steps=0`` adopts the init target unchanged, so that ``--init-draft``
continues a draft against the target it was trained for); the
changed scale is recorded, and a directory only resumes under the scale it was started with.

Scales. ``tiny``: seconds on a CPU (seq 256, a handful of steps): it tests the pipeline, not the model. ``h200``:
vocab 8192; target hidden 384, 8 layers, 6 heads / 2 KV heads (head dim 64), MLP 1024, tied embeddings (about
15.7M parameters, 31 MB in bf16, so that target + draft + tokenizer ship in under 40 MB), rope_theta 1e6,
max_position_embeddings 65536 (32k prompts plus generation fit); target seq 8192 x batch 8 for 300 s, of which the
last quarter of the steps train on 32k-token windows (batch 2); each draft seq 8192 x batch 4 for 120 s.
Long-context mode at h200 (from the old 8-layer pair, trained on 8k windows): 230 s of continuation, three quarters of
the steps on 32k x 2 windows, then 64k x 1, peak LR 5e-4; RoPE base 1e6 -> 8.55e6 (NTK scaling for 8k -> 64k),
max_position_embeddings 131072; drafts on 32k x 1 windows with KL weight 1 for 120 s each; stage ``short`` 45 s
per variant on 1024 x 32 windows. ``h200-deep`` (issue 33): hidden 256, 16 layers, 4 / 2 heads, MLP 896 (16.3M
parameters), rope_theta 1e7 and 131072 positions; 440 s of target training whose windows grow (``target_windows``:
60% of the steps on 2k x 32, 30% 8k x 8, 7% 32k x 2, 3% 64k x 1); the draft on 32k x 1 windows with KL weight 1
for 420 s, continued (long-context mode) by pure distillation (``long_draft_ce_weight=0``); the shipped pair since
2026-12-05. (The old 8-layer pair,
``benchmarks/results/h200/recipe.json``, predates the
long-window quarter and this mode: its target saw 8k windows only, and its tau falls beyond 8k.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import asdict
from typing import Sequence

import torch

from longspec.recipes.long_context import file_sha256
from longspec.recipes.pair_config import (DEFAULT_STAGES, SCALES, SEED, SHIP_LIMIT_BYTES, STAGES, Scale,  # noqa: F401
                                          _jsonable, _loss_summary, _read_json, _write_json, scale_with)
from longspec.recipes.pair_data import _Recipe, _stage_data, _tokenizer, heldout_chars, pretokenize  # noqa: F401
from longspec.recipes.pair_draft import (DRAFT_VARIANTS, SHORT_VARIANTS, DraftRun, _stage_drafts,  # noqa: F401
                                         _stage_short,
                                         ablation_summary, long_draft_run, probe_draft_step_s, scratch_draft_run,
                                         short_draft_run, steps_to_loss, stride_sample, train_draft)
from longspec.recipes.pair_export import export_pair  # noqa: F401
from longspec.recipes.pair_target import (TargetRun, _stage_target, _TargetTrainer, budget_steps,  # noqa: F401
                                          build_target, continuation_run, eval_by_context, eval_loss,
                                          init_target_info, load_init_target, probe_target_step_s,
                                          scratch_run, train_target)

# --- the recipe ---------------------------------------------------------------------------------------------------


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
    for f in dataclasses.fields(Scale):  # a record from before a field was added holds its default
        if f.default is not dataclasses.MISSING:
            recorded.setdefault(f.name, _jsonable(f.default))
    if recorded != _jsonable(asdict(s)):
        differ = sorted(k for k, v in _jsonable(asdict(s)).items() if recorded.get(k) != v)
        raise ValueError(f"{out} holds a recipe of another scale ({recorded.get('name')}; fields that differ: "
                         f"{', '.join(differ)}); use a fresh --out")
    if r.long:
        info = init_target_info(init_target)
        # long_from_seq == long_to_seq: a target already trained for the context, continued at its RoPE base
        if s.long_from_seq > s.long_to_seq or max(w[0] for w in s.long_windows) > s.long_to_seq:
            raise ValueError(f"scale {s.name}: long_from_seq ({s.long_from_seq}) must be at most long_to_seq "
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
