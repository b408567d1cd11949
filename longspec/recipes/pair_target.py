"""The code pair recipe's target stage: tokens on disk, the target trained from scratch or continued on long windows,
its held-out losses (:mod:`longspec.recipes.code_pair`)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from longspec.recipes.long_context import (
    Window,
    file_sha256,
    ntk_rope_theta,
    phase_steps,
    random_windows,
    window_tokens,
)
from longspec.recipes.pair_config import SEED, Scale, _loss_summary
from longspec.recipes.pair_data import _Recipe, _tokenizer
from longspec.train.trainer import warmup_cosine

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
    if s.target_windows is not None:
        return TargetRun(tuple(tuple(w) for w in s.target_windows), s.target_lr, s.target_warmup_ratio)
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


def _stage_target(r: _Recipe, target_steps: int | None) -> None:
    s, record, dev = r.s, r.record, r.dev
    if r.long and s.long_steps == 0:  # no training: neither the token file nor stage data is needed
        _adopt_init_target(r)
        return
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
             "windows": [list(w) for w in run.windows], "steps_per_window": phase_steps(run.windows, steps),
             "loss": _loss_summary(history, s.log_every),
             "heldout_loss": eval_loss(target, held, s, dev) if held is not None else None}
    if r.long:
        entry.update(init_from=record["init"]["target"]["dir"], lr=run.lr,
                     rope_theta={"from": record["init"]["target"]["rope_theta"], "to": theta,
                                 "rule": f"NTK: theta * ({s.long_to_seq}/{s.long_from_seq}) ** (d / (d - 2)), "
                                         f"d = head_dim {record['init']['target']['head_dim']}"},
                     max_position_embeddings=max_pos,
                     heldout_loss_by_context=eval_by_context(target, held, s, dev) if held is not None else None)
    else:
        entry["heldout_loss_long"] = (eval_loss(target, held, s, dev, s.target_long_seq, max(1, s.eval_windows // 4))
                                      if held is not None else None)
        entry["heldout_loss_by_context"] = eval_by_context(target, held, s, dev) if held is not None else None
    record["target"] = entry
    target.save_pretrained(r.target_dir)
    tokenizer.save_pretrained(r.target_dir)
    del target
    r.lap("target")


def _adopt_init_target(r: _Recipe) -> None:
    """Long-context mode with ``long_steps`` 0: the init target is the recipe's target as it is (its files, RoPE
    base and positions unchanged), so the drafts can go on training against a target that is final."""
    import shutil

    from transformers import AutoModelForCausalLM

    s, record, dev = r.s, r.record, r.dev
    init = record["init"]["target"]
    os.makedirs(r.target_dir, exist_ok=True)
    for name in os.listdir(r.init_target):
        if os.path.isfile(os.path.join(r.init_target, name)):
            shutil.copy2(os.path.join(r.init_target, name), r.target_dir)
    held = r.held_tokens(_tokenizer(r))
    target = AutoModelForCausalLM.from_pretrained(r.target_dir, dtype=torch.bfloat16).to(dev).eval()
    by_context = eval_by_context(target, held, s, dev) if held is not None else None
    init.setdefault("heldout_loss", by_context)
    record["target"] = {"dir": r.target_dir, "params": sum(p.numel() for p in target.parameters()), "steps": 0,
                        "adopted": True, "init_from": init["dir"], "tokens_seen": 0, "windows": [],
                        "steps_per_window": [], "loss": {"first": None, "last": None, "every": s.log_every,
                                                         "curve": []},
                        "rope_theta": {"from": init["rope_theta"], "to": init["rope_theta"], "rule": "unchanged"},
                        "max_position_embeddings": init["max_position_embeddings"],
                        "heldout_loss": eval_loss(target, held, s, dev) if held is not None else None,
                        "heldout_loss_by_context": by_context}
    del target
    r.lap("target")


def _load_target_fp32(r: _Recipe):
    """float32 copies of the bf16 weights: fp32 master weights for the drafts, bf16 autocast in the trainer."""
    from transformers import AutoModelForCausalLM

    if "target" not in r.record:
        raise ValueError(f"stages 'drafts' and 'short' need the target: run stage 'target' into {r.out} first")
    return AutoModelForCausalLM.from_pretrained(r.target_dir, dtype=torch.float32).to(r.dev).eval()
