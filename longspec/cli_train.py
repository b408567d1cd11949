"""``longspec train``: the draft trainer's subcommand (registered by :func:`longspec.cli.build_parser`). Its
arguments and files are checked before torch is imported, like every subcommand's."""
from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Optional

from longspec.cli_types import DTYPES, float_arg, int_arg
from longspec.inputs import CLIError, check_draft, check_target
from longspec.runs import checkpoint_step, latest_checkpoint


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a LongSpec draft for a local target (torchrun for several GPUs)",
                       description="Train a LongSpec draft; checkpoints load with LongSpecDraft.from_pretrained "
                                   "(the --out directory stands for its latest one). Launch with torchrun "
                                   "--nproc-per-node K for K ranks.")
    p.add_argument("--target", required=True, help="local directory of the target model and tokenizer")
    p.add_argument("--data", required=True, nargs="+", help="jsonl / text / parquet files or globs (hf:NAME too)")
    p.add_argument("--field", default="text", help="text field of jsonl records / parquet columns")
    p.add_argument("--out", required=True, help="output directory (checkpoints, log.jsonl); resumed if present")
    p.add_argument("--draft-init", default=None, help="start from this draft checkpoint instead of a fresh one")
    p.add_argument("--draft-intermediate", type=int_arg(1), default=None, metavar="N",
                   help="with --draft-init: widen its MLP to N units first, without changing its function (the new "
                        "units start silent; longspec.model.draft_grow.widen_mlp). A resumed run keeps its width")
    p.add_argument("--draft-add-cross-blocks", type=int_arg(1), default=None, metavar="N",
                   help="with --draft-init: append N cross-attention + MLP blocks that start as the identity "
                        "(longspec.model.draft_grow.add_cross_blocks; not part of the LongSpec method, each costs a "
                        "draft level one more pass over the target's last-layer cache). A resumed run keeps them")
    p.add_argument("--seq-len", type=int_arg(2), default=1024)
    p.add_argument("--steps", type=int_arg(1), default=1000)
    p.add_argument("--batch-size", type=int_arg(1), default=1, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int_arg(1), default=1)
    p.add_argument("--lr", type=float_arg(0.0, lo_open=True), default=5e-4)
    p.add_argument("--kl-weight", type=float_arg(0.0), default=0.0, help="weight of KL(target || draft) added to the CE")
    p.add_argument("--ce-weight", type=float_arg(0.0), default=1.0,
                   help="weight of the CE on the data's next tokens (0 with --kl-weight > 0: pure distillation)")
    p.add_argument("--draft-vocab-size", type=int_arg(0), default=0,
                   help="checkpoints carry the N most frequent training tokens as the draft's reduced vocabulary")
    p.add_argument("--delta-max", type=int_arg(1), default=5, help="flash noisy: largest lag of the target K/V")
    p.add_argument("--no-anchor-offset", action="store_true", help="plain positions (ablation)")
    p.add_argument("--no-flash-noisy", action="store_true", help="always lag 1 (ablation)")
    p.add_argument("--parallel", choices=("none", "ddp", "fsdp"), default=None,
                   help="default: ddp under a multi-process launch (torchrun), none in a single process")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="target weights' dtype on CUDA")
    p.add_argument("--seed", type=int_arg(0), default=0)
    p.add_argument("--save-every", type=int_arg(1), default=200)
    p.add_argument("--log-every", type=int_arg(1), default=10, help="steps between log.jsonl rows")
    p.add_argument("--tensorboard", action="store_true")
    p.set_defaults(run=run_train)


def launch_parallel(requested: Optional[str], world_size: int) -> str:
    """The parallel mode: what the launch implies (ddp under torchrun with several ranks, else none), or the one
    requested when it fits the launch."""
    if requested is None:
        return "ddp" if world_size > 1 else "none"
    if requested != "none" and world_size == 1:
        raise CLIError(f"--parallel {requested} needs several processes: launch with torchrun --nproc-per-node K "
                       "(K > 1), or leave --parallel out")
    if requested == "none" and world_size > 1:
        raise CLIError(f"--parallel none under a {world_size}-process launch would train {world_size} separate "
                       "drafts into one --out: use ddp or fsdp")
    return requested


def run_train(args: argparse.Namespace) -> int:
    parallel = launch_parallel(args.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    target_files = check_target(args.target)
    for pattern in args.data:
        if not pattern.startswith("hf:") and not any(os.path.isfile(m) for m in glob.glob(pattern, recursive=True)):
            raise CLIError(f"--data {pattern!r} matches no file")
    if args.draft_init:
        check_draft(args.draft_init, target_files, "--draft-init")
    elif args.draft_intermediate is not None:
        raise CLIError("--draft-intermediate widens the --draft-init draft: give --draft-init too")
    elif args.draft_add_cross_blocks is not None:
        raise CLIError("--draft-add-cross-blocks grows the --draft-init draft: give --draft-init too")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CLIError(f"--out {args.out!r} is a file, not a directory")
    done = _finished_step(args.out)
    if done is not None and done >= args.steps:
        print(f"longspec: {args.out} already holds a run trained to step {done} (--steps {args.steps}): nothing to "
              "do; raise --steps to train further", file=sys.stderr)
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longspec import LongSpecDraft
    from longspec.train import DataConfig, Parallel, TrainConfig, train

    kwargs = dict(local_files_only=True, **target_files.from_pretrained_kwargs())
    tokenizer = AutoTokenizer.from_pretrained(target_files.directory, **kwargs)
    dtype = getattr(torch, args.dtype) if torch.cuda.is_available() else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_files.directory, dtype=dtype, **kwargs)
    draft = None
    if args.draft_init and done is None:  # a resume builds the draft from its own checkpoint
        draft = LongSpecDraft.from_pretrained(args.draft_init, target=target, dtype=torch.float32)
        if args.draft_intermediate is not None and args.draft_intermediate != draft.config.intermediate_size:
            from longspec.model.draft_grow import widen_mlp

            try:
                draft = widen_mlp(draft, args.draft_intermediate, seed=args.seed)
            except ValueError as err:
                raise CLIError(f"--draft-intermediate {args.draft_intermediate}: {err}") from None
        if args.draft_add_cross_blocks is not None:
            from longspec.model.draft_grow import add_cross_blocks

            draft = add_cross_blocks(draft, args.draft_add_cross_blocks, seed=args.seed)
    cfg = TrainConfig(data=DataConfig(paths=args.data, field=args.field, seq_len=args.seq_len), out_dir=args.out,
                      steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      kl_weight=args.kl_weight, ce_weight=args.ce_weight, draft_vocab_size=args.draft_vocab_size,
                      delta_max=args.delta_max, anchor_offset=not args.no_anchor_offset,
                      flash_noisy=not args.no_flash_noisy, parallel=Parallel(parallel), seed=args.seed,
                      save_every=args.save_every, log_every=args.log_every, tensorboard=args.tensorboard)
    try:
        history = train(cfg, target, tokenizer, draft=draft)
    except KeyError as err:  # a data record without --field (the message names the file and line)
        raise CLIError(err.args[0] if err.args else repr(err)) from None
    if not history:  # the run reached --steps between the check above and the resume (another process)
        print(f"longspec: {args.out} already holds a run trained to --steps {args.steps}: nothing to do",
              file=sys.stderr)
        return 0
    last = history[-1]
    print(f"trained to step {last['step']}: loss {last['loss']:.4f} (checkpoints in {args.out})", file=sys.stderr)
    return 0


def _finished_step(out: str) -> Optional[int]:
    """The step of the run's latest checkpoint in ``out``, or None when there is none."""
    try:
        ckpt = latest_checkpoint(out) if os.path.isdir(out) else None
        return None if ckpt is None else checkpoint_step(ckpt)
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(f"--out {out!r}: {err}") from None
