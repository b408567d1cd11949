"""The draft training loop: one CPU, one GPU, or many GPUs under ``torchrun`` (DDP or FSDP2).

Each optimizer step accumulates ``grad_accum`` micro-batches per rank. Every micro-batch draws one anchor-offset
position vector (shared by its rows, target and draft alike) and one flash-noisy delta in 1..delta_max. AdamW with
linear warm-up and cosine decay, gradient clipping, bf16 autocast on CUDA. Checkpoints are a
``LongSpecDraft.save_pretrained`` directory (safetensors + config) plus ``trainer_state.pt`` (optimizer, scheduler,
RNG, data position), and resuming from one reproduces the run exactly.
"""
from __future__ import annotations

import enum
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from longspec.runs import LATEST, latest_checkpoint

from .data import DataConfig, PackedStream, Prefetch, batches
from .loss import check_loss_weights
from .objective import prepare_target, step_loss
from .positions import anchor_offset_positions


class Parallel(enum.Enum):
    NONE = "none"
    DDP = "ddp"
    FSDP = "fsdp"


@dataclass
class TrainConfig:
    """Everything one training run needs. ``delta_max`` defaults to 5: the deepest drafted level of the default
    4-16-16-16-16 tree (depth-4 nodes) reads target rows 5 positions back."""

    data: DataConfig = field(default_factory=DataConfig)
    out_dir: str = "draft-out"
    steps: int = 1000
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-6
    clip: float = 1.0
    anchor_offset: bool = True
    max_sink: int = 4
    max_positions: int | None = None  # default: the target's max_position_embeddings
    flash_noisy: bool = True
    delta_max: int = 5
    kl_weight: float = 0.0
    ce_weight: float = 1.0  # 0 with kl_weight > 0: pure distillation to the target (see chunked_lm_loss)
    loss_chunk: int = 1024
    draft_vocab_size: int = 0  # > 0: checkpoints carry the N most frequent training tokens (draft_vocab.json)
    bf16: bool = True  # autocast on CUDA
    parallel: Parallel = Parallel.NONE
    seed: int = 0
    save_every: int = 200
    log_every: int = 10
    tensorboard: bool = False
    progress: bool = True

    def validate(self, target, tokenizer) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("steps, batch_size and grad_accum must be >= 1")
        if self.delta_max < 1:
            raise ValueError(f"delta_max must be >= 1, got {self.delta_max}")
        check_loss_weights(self.ce_weight, self.kl_weight)  # before any weight or data is loaded
        max_pos = self.max_positions or target.config.max_position_embeddings
        if self.data.seq_len > max_pos:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) is longer than the target supports "
                             f"(max_position_embeddings {max_pos})")
        if self.data.seq_len <= self.delta_max:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) must exceed delta_max ({self.delta_max})")
        vocab = target.get_output_embeddings().weight.shape[0]
        if not 0 <= self.draft_vocab_size <= vocab:
            raise ValueError(f"draft_vocab_size must be in [0, {vocab}] (0: the full vocabulary), got "
                             f"{self.draft_vocab_size}")
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the target's LM head has {vocab} rows")


def warmup_cosine(warmup: int, steps: int, min_ratio: float = 0.1):
    """LR multiplier for LambdaLR: linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio``."""
    warmup = max(1, warmup)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return f


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def _init_distributed() -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return _Dist(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return _Dist(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def _wrap(draft, cfg: TrainConfig, d: _Dist):
    if cfg.parallel is Parallel.DDP and d.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(draft, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    if cfg.parallel is Parallel.FSDP and d.world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(draft)
    return draft


def _full_state(model, optimizer, d: _Dist):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def _load_state(model, optimizer, model_sd, optim_sd):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)


class TokenCounts:
    """Occurrences of every token id in the training data, for the draft's reduced vocabulary
    (``draft_vocab.json``, :func:`longspec.model.draft.frequent_tokens`). Each rank counts what it trains on; a
    checkpoint sums them onto rank 0, which keeps the total (so resuming continues the count exactly)."""

    def __init__(self, vocab_size: int, size: int, d: _Dist) -> None:
        self.size, self.d = size, d
        self.counts = torch.zeros(vocab_size, dtype=torch.int64, device=d.device)

    def add(self, ids: torch.Tensor) -> None:
        if self.size:
            self.counts += torch.bincount(ids.flatten(), minlength=self.counts.numel())

    def total(self) -> torch.Tensor:
        """The sum over ranks (a collective: every rank calls it); rank 0 keeps it, the others restart at 0."""
        if self.d.world > 1:
            dist.all_reduce(self.counts)
            if not self.d.main:
                self.counts.zero_()
        return self.counts.cpu()


def save_checkpoint(path: Path, draft, model, optimizer, scheduler, rng: torch.Generator, step: int, d: _Dist,
                    counts: TokenCounts | None = None) -> None:
    """``path`` gets the draft (safetensors + config, loadable by LongSpecDraft.from_pretrained) and trainer_state.pt
    (plus ``draft_vocab.json`` when ``counts`` asks for a reduced drafting vocabulary)."""
    from longspec.model.draft import frequent_tokens, save_draft_vocab

    model_sd, optim_sd = _full_state(model, optimizer, d)  # collective under FSDP: every rank calls it
    total = counts.total() if counts is not None and counts.size else None  # collective too
    rngs = _rng_states(rng, d)  # and this: each rank draws its own positions and deltas
    if d.main:
        path.mkdir(parents=True, exist_ok=True)
        draft.save_pretrained(path, state_dict=model_sd)
        if total is not None:
            save_draft_vocab(path, frequent_tokens(total, counts.size))
        torch.save({"optimizer": optim_sd, "scheduler": scheduler.state_dict(), "rng": rngs[0], "rng_per_rank": rngs,
                    "step": step, "world": d.world, "token_counts": total}, path / "trainer_state.pt")
        (path.parent / LATEST).write_text(path.name)
    if d.world > 1:
        dist.barrier()


def _rng_states(rng: torch.Generator, d: _Dist) -> list[torch.Tensor]:
    """Every rank's generator state, in rank order, on rank 0 (a collective; the other ranks get an empty list)."""
    if d.world == 1:
        return [rng.get_state()]
    states = [None] * d.world if d.main else None
    dist.gather_object(rng.get_state(), states, dst=0)
    return states if d.main else []


def _resume(out_dir: Path, draft_cls, target, model, optimizer, scheduler, rng, d: _Dist,
            counts: TokenCounts) -> int:
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        return 0
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
    if state["world"] != d.world:
        raise ValueError(f"{ckpt} was written by {state['world']} ranks; resume with the same world size ({d.world})")
    saved = draft_cls.from_pretrained(ckpt, target=target)
    _load_state(model, optimizer, saved.state_dict(), state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    # each rank resumes its own generator; checkpoints written before rng_per_rank hold rank 0's only
    per_rank = state.get("rng_per_rank")
    rng.set_state(per_rank[d.rank] if per_rank else state["rng"])
    if d.main and state.get("token_counts") is not None and counts.size:
        counts.counts.copy_(state["token_counts"])
    return int(state["step"])


class _Logger:
    """``log.jsonl`` (one row per logged step) and optionally TensorBoard. A resumed run first drops the rows past
    its checkpoint (logged before an interruption, then computed again), so every step appears once."""

    def __init__(self, out_dir: Path, cfg: TrainConfig, d: _Dist, resumed_step: int):
        self.main = d.main
        path = out_dir / "log.jsonl"
        if d.main and path.exists():
            rows = [line for line in path.read_text().splitlines() if line.strip()]
            kept = [line for line in rows if json.loads(line)["step"] <= resumed_step]
            if len(kept) != len(rows):
                path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a") if d.main else None
        self.tb = None
        if d.main and cfg.tensorboard:
            # UNTESTED: tensorboard is not installed in CI; the jsonl log is the tested record.
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, row: dict) -> None:
        if not self.main:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _micro_batch(model, target, data, rng, cfg: TrainConfig, max_pos: int, d: _Dist, autocast, last: bool,
                 counts: TokenCounts):
    """Forward + backward of one micro-batch; returns its mean loss (a float) and token count."""
    ids = next(data).to(d.device)
    counts.add(ids)
    pos = anchor_offset_positions(ids.shape[1], max_pos, rng, cfg.max_sink, cfg.anchor_offset)
    delta = int(torch.randint(1, cfg.delta_max + 1, (1,), generator=rng)) if cfg.flash_noisy else 1
    no_sync = getattr(model, "no_sync", None)
    ctx = no_sync() if (no_sync is not None and not last) else _null()
    with ctx:
        with autocast:
            loss_sum, n = step_loss(model, target, ids, pos, delta, cfg.kl_weight, cfg.loss_chunk, cfg.ce_weight)
        (loss_sum / (n * cfg.grad_accum)).backward()
    return float(loss_sum.detach()) / n, n


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _mean_across_ranks(x: float, d: _Dist) -> float:
    if d.world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return float(t) / d.world


def _json_value(x):
    """train_config.json: enums by value (``"parallel": "ddp"``), anything else as its string."""
    return x.value if isinstance(x, enum.Enum) else str(x)


def train(cfg: TrainConfig, target, tokenizer, draft=None) -> list[dict]:
    """Train a LongSpec draft for ``target`` (a Hugging Face causal LM) and return the per-step log rows.

    ``draft`` defaults to ``LongSpecDraft.from_target(target)``, or to the geometry of an existing checkpoint in
    ``cfg.out_dir`` (its ``latest`` pointer: a widened draft resumes at its width), which is resumed exactly; a run
    already at ``cfg.steps`` returns no rows. Launch with ``torchrun --nproc-per-node K`` for K ranks.
    """
    from tqdm.auto import tqdm

    from longspec.model.draft import LongSpecDraft

    d = _init_distributed()
    torch.manual_seed(cfg.seed)
    cfg.validate(target, tokenizer)
    target.to(d.device)
    prepare_target(target)
    use_bf16 = cfg.bf16 and d.device.type == "cuda"
    if draft is None:
        ckpt = latest_checkpoint(cfg.out_dir) if os.path.isdir(cfg.out_dir) else None
        draft = LongSpecDraft.from_target(target) if ckpt is None else LongSpecDraft.from_pretrained(ckpt, target=target)
        if use_bf16:
            draft.float()  # float32 master weights under bf16 autocast, whatever the target's dtype
    draft = draft.to(d.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # cross_attn.k_proj / v_proj are dead (keys and values come from the target): kept for checkpoint
    # compatibility, never trained.
    draft.cross_attn.k_proj.requires_grad_(False)
    draft.cross_attn.v_proj.requires_grad_(False)
    model = _wrap(draft, cfg, d)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(int(cfg.warmup_ratio * cfg.steps), cfg.steps, cfg.min_lr_ratio))
    rng = torch.Generator().manual_seed(cfg.seed + d.rank)
    counts = TokenCounts(target.get_output_embeddings().weight.shape[0], cfg.draft_vocab_size, d)
    step = _resume(out, LongSpecDraft, target, model, optimizer, scheduler, rng, d, counts)
    data = Prefetch(batches(PackedStream(cfg.data, tokenizer, rank=d.rank, world_size=d.world), cfg.batch_size,
                            start_batch=step * cfg.grad_accum))
    max_pos = cfg.max_positions or target.config.max_position_embeddings
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else _null()
    if d.main:
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), default=_json_value, indent=1))
    logger, history = _Logger(out, cfg, d, step), []
    bar = tqdm(total=cfg.steps, initial=step, disable=not (d.main and cfg.progress), desc="train")
    try:
        while step < cfg.steps:
            t0 = time.perf_counter()
            losses = [_micro_batch(model, target, data, rng, cfg, max_pos, d, autocast, i == cfg.grad_accum - 1,
                                   counts) for i in range(cfg.grad_accum)]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, cfg.clip))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if d.device.type == "cuda":
                torch.cuda.synchronize(d.device)
            dt = time.perf_counter() - t0
            tokens = cfg.grad_accum * cfg.batch_size * cfg.data.seq_len * d.world
            row = {"step": step, "loss": _mean_across_ranks(sum(l for l, _ in losses) / len(losses), d),
                   "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "tokens_per_s": tokens / dt}
            history.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}")
            if step % cfg.log_every == 0 or step == cfg.steps:
                logger.log(row)
            if step % cfg.save_every == 0 or step == cfg.steps:
                save_checkpoint(out / f"checkpoint-{step}", draft, model, optimizer, scheduler, rng, step, d, counts)
    finally:
        data.close()  # no prefetch thread outlives the run
    bar.close()
    logger.close()
    return history
