"""The code pair recipe's scales (model sizes, budgets, windows), stages and record files
(:mod:`longspec.recipes.code_pair`)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Sequence

from longspec.recipes.long_context import Window, parse_windows

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
    long_steps: int  # 0: no continuation, the init target as it is (drafts trained on against a final target)
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
    draft_kl_weight: float = 0.0  # the from-scratch drafts' KL term (long-context mode: long_draft_kl_weight)
    # the from-scratch target's window phases (SEQ, BATCH, share of the steps), in order; None: target_seq x
    # target_batch, then the last target_long_ratio of the steps on target_long_seq windows
    target_windows: tuple[Window, ...] | None = None
    # tokens per chunk of the drafts' LM-head loss: larger chunks launch fewer kernels (a 32k-token step at 1024
    # is host-bound) for chunk x vocab float32 logits each (8192 x 8192 x 4 B = 256 MB)
    draft_loss_chunk: int = 1024
    # the long-context drafts' CE term (0: pure distillation, KL to the target only; see chunked_lm_loss)
    long_draft_ce_weight: float = 1.0
    # the continued draft's MLP units (None: the init draft's); more than it has widens it without changing its
    # function first (longspec.model.draft_grow.widen_mlp)
    long_draft_intermediate: int | None = None
    # extra cross-attention + MLP blocks appended to the init draft, each starting as the identity
    # (longspec.model.draft_grow.add_cross_blocks; not the LongSpec method's one-block draft); 0: none
    long_draft_add_cross_blocks: int = 0


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
# Issue 33's deeper pair, shaped like real targets (a one-block draft against 16 layers, not 8): 16.3M target
# parameters (target + draft + tokenizer in bf16 under SHIP_LIMIT_BYTES), RoPE base for 128k positions; its draft
# on 32k windows with the KL term. The target's windows grow as long-context models' do: 60% of the steps on 2k
# windows (attention is most of an 8k step's time at hidden 256: a 2k step of the same 65k tokens costs about half),
# then 8k, 32k and 64k (the first deep run spent 10% of its steps, 39% of its time, on 64k windows). The rest as
# h200, with budgets that leave each device call room for its other work. A continued draft (long-context mode) takes
# two 32k windows a step with 8192-token loss chunks: 424k tokens/s on an H100, against ~240k for one window a step
# with 1024-token chunks on an H200 (the step was host-bound; recipe_deep_cont2.json). It learns by pure distillation
# (long_draft_ce_weight=0, KL to the target only): its fourth continuation so raised the tree's tau in every cell
# measured, and KL alone accepted the most in the CPU experiment (benchmarks/results/h100/NOTES.md, 2026-12-06).
SCALES["h200-deep"] = dataclasses.replace(
    SCALES["h200"], name="h200-deep", hidden=256, intermediate=896, layers=16, heads=4, kv_heads=2,
    max_positions=131072, rope_theta=10_000_000.0, target_long_seq=65536, target_long_ratio=0.1,
    target_windows=((2048, 32, 0.6), (8192, 8, 0.3), (32768, 2, 0.07), (65536, 1, 0.03)),
    target_steps=20000, target_seconds=440.0, draft_seq=32768, draft_batch=1, draft_steps=20000,
    draft_seconds=420.0, draft_kl_weight=1.0, long_steps=20000, long_seconds=420.0, long_draft_batch=2,
    draft_loss_chunk=8192, long_draft_ce_weight=0.0)
STAGES = ("data", "target", "drafts", "short")
DEFAULT_STAGES = ("data", "target", "drafts")


def scale_with(s: Scale, assignments: Sequence[str]) -> Scale:
    """``s`` with ``FIELD=VALUE`` assignments applied (``--set``): numbers, ``none`` for an optional budget,
    ``long_windows`` / ``target_windows`` as ``SEQxBATCH:SHARE,...`` and the context tuples as ``N,N,...``."""
    fields = {f.name: f for f in dataclasses.fields(Scale)}
    changes = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep or name not in fields or name == "name":
            raise ValueError(f"--set: expected FIELD=VALUE with FIELD a scale field other than name "
                             f"({', '.join(n for n in fields if n != 'name')}), got {item!r}")
        current = getattr(s, name)
        try:
            if text.lower() == "none" and "None" in str(fields[name].type):
                value = None
            elif name in ("long_windows", "target_windows"):
                value = parse_windows(text, name)
            elif isinstance(current, tuple):
                value = tuple(int(x) for x in text.split(","))
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


def _loss_summary(history: list[dict], every: int) -> dict:
    return {"first": history[0]["loss"], "last": history[-1]["loss"],
            "every": every, "curve": [[h["step"], round(h["loss"], 5)] for h in history
                                      if h["step"] == 1 or h["step"] % every == 0 or h is history[-1]]}
