"""The ``longspec`` command line: ``longspec generate | train | demo``.

Each subcommand registers itself in :func:`build_parser` with an ``add_<name>_parser`` function and a ``run``
callable taking the parsed arguments and returning an exit code.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CLIError(Exception):
    """A user-facing error: printed as ``longspec: error: ...`` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longspec", description="Long-context lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(sub)
    add_train_parser(sub)
    add_demo_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CLIError, ValueError) as err:
        print(f"longspec: error: {err}", file=sys.stderr)
        return 2


# -- generate -------------------------------------------------------------------------------------------------------


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a local Hugging Face model, speculatively",
                       description="Stream a continuation of --prompt-file to stdout; stats go to stderr.")
    p.add_argument("--target", required=True, help="local directory of the target model and tokenizer")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="local directory of a LongSpec draft trained for the target")
    draft.add_argument("--drafter", choices=("pld", "streaming", "none"), default=None,
                       help="built-in drafter when --draft is not given (default: pld)")
    p.add_argument("--prompt-file", required=True, help="text file holding the prompt ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seed-exact sampling (same tokens as plain decoding)")
    p.add_argument("--tree-shape", type=int, nargs="+", default=None,
                   help="nodes per depth (default: 4 16 16 16 16 with --draft, else 1 1 1 1 1)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cuda-graphs", action="store_true", help="capture the target forwards as CUDA graphs")
    p.add_argument("--max-cache-len", type=int, default=None, help="refuse requests needing more cache rows")
    p.add_argument("--sink", type=int, default=32, help="streaming drafter: attention-sink rows")
    p.add_argument("--window", type=int, default=1024, help="streaming drafter: recent-window rows")
    p.add_argument("--max-ngram", type=int, default=3, help="pld drafter: longest n-gram matched")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from longspec import SpeculativeDecoder

    tokenizer, model = _load_target(args.target, _DTYPES[args.dtype], args.device)
    prompt_ids = _encode_prompt(tokenizer, _read_prompt(args.prompt_file), args.chat).to(args.device)
    drafter = _build_drafter(args, model)
    tree_shape = args.tree_shape or ((4, 16, 16, 16, 16) if args.draft else (1, 1, 1, 1, 1))
    decoder = SpeculativeDecoder(model, drafter, tree_shape=tree_shape, cuda_graphs=args.cuda_graphs,
                                 max_cache_len=args.max_cache_len)
    out = decoder.generate(prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, streamer=_TextStreamer(tokenizer))
    print(flush=True)
    print(out.stats.summary(), file=sys.stderr)
    return 0


def _load_target(path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(path).is_dir():
        raise CLIError(f"--target {path!r} is not a directory")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    return tokenizer, model


def _read_prompt(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise CLIError(f"cannot read --prompt-file {path!r}: {err.strerror}") from err


def _encode_prompt(tokenizer, text: str, chat: bool) -> torch.Tensor:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise CLIError("the prompt is empty after tokenization")
    return ids


def _build_drafter(args: argparse.Namespace, model):
    from longspec import PromptLookupDrafter, StreamingSelfDrafter

    if args.draft:
        return _load_longspec_drafter(args.draft, model)
    builders: dict[str, Callable[[], object]] = {
        "pld": lambda: PromptLookupDrafter(max_ngram=args.max_ngram),
        "streaming": lambda: StreamingSelfDrafter(sink=args.sink, window=args.window),
        "none": lambda: None,
    }
    return builders[args.drafter or "pld"]()


def _load_longspec_drafter(path: str, model):
    """``longspec.LongSpecDrafter(longspec.LongSpecDraft.from_pretrained(path, target=model))``, checked."""
    try:
        from longspec import LongSpecDraft, LongSpecDrafter
    except ImportError as err:
        raise CLIError(f"--draft needs longspec.LongSpecDraft and longspec.LongSpecDrafter, unavailable here ({err})") from err
    draft = LongSpecDraft.from_pretrained(path, target=model)
    draft_vocab = getattr(getattr(draft, "config", None), "vocab_size", None)
    target_vocab = model.config.vocab_size
    if draft_vocab is not None and draft_vocab != target_vocab:
        raise CLIError(f"the draft's vocabulary ({draft_vocab} tokens, {path}) differs from the target's ({target_vocab})")
    return LongSpecDrafter(draft)


class _TextStreamer:
    """Prints row 0's new text after every round (decoding the whole output keeps multi-token characters intact)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        self.ids.extend(tokens[0, : int(counts[0])].tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)


# -- train ----------------------------------------------------------------------------------------------------------


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a LongSpec draft for a local target (torchrun for several GPUs)",
                       description="Train a LongSpec draft; checkpoints load with LongSpecDraft.from_pretrained. "
                                   "Launch with torchrun --nproc-per-node K for K ranks.")
    p.add_argument("--target", required=True, help="local directory of the target model and tokenizer")
    p.add_argument("--data", required=True, nargs="+", help="jsonl / text / parquet files or globs (hf:NAME too)")
    p.add_argument("--field", default="text", help="text field of jsonl records / parquet columns")
    p.add_argument("--out", required=True, help="output directory (checkpoints, log.jsonl); resumed if present")
    p.add_argument("--draft-init", default=None, help="start from this draft checkpoint instead of a fresh one")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--kl-weight", type=float, default=0.0, help="weight of KL(target || draft) added to the CE")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="checkpoints carry the N most frequent training tokens as the draft's reduced vocabulary")
    p.add_argument("--delta-max", type=int, default=5, help="flash noisy: largest lag of the target K/V")
    p.add_argument("--no-anchor-offset", action="store_true", help="plain positions (ablation)")
    p.add_argument("--no-flash-noisy", action="store_true", help="always lag 1 (ablation)")
    p.add_argument("--parallel", choices=("none", "ddp", "fsdp"), default="ddp")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16", help="target weights' dtype on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10, help="steps between log.jsonl rows")
    p.add_argument("--tensorboard", action="store_true")
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longspec.train import DataConfig, Parallel, TrainConfig, train

    if not Path(args.target).is_dir():
        raise CLIError(f"--target {args.target!r} is not a directory")
    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    dtype = _DTYPES[args.dtype] if torch.cuda.is_available() else torch.float32
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, local_files_only=True)
    draft = None
    if args.draft_init:
        from longspec import LongSpecDraft

        draft = LongSpecDraft.from_pretrained(args.draft_init, target=target, dtype=torch.float32)
    cfg = TrainConfig(data=DataConfig(paths=args.data, field=args.field, seq_len=args.seq_len), out_dir=args.out,
                      steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      kl_weight=args.kl_weight, draft_vocab_size=args.draft_vocab_size,
                      delta_max=args.delta_max, anchor_offset=not args.no_anchor_offset,
                      flash_noisy=not args.no_flash_noisy, parallel=Parallel(args.parallel), seed=args.seed,
                      save_every=args.save_every, log_every=args.log_every, tensorboard=args.tensorboard)
    history = train(cfg, target, tokenizer, draft=draft)
    last = history[-1] if history else {}
    print(f"trained to step {last.get('step', 0)}: loss {last.get('loss', float('nan')):.4f}", file=sys.stderr)
    return 0


# -- demo -----------------------------------------------------------------------------------------------------------


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the shipped trained pair on a held-out long code prompt: plain vs speculative")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16 is faster on a GPU, but outputs may then part at near-ties of the target's logits")
    p.add_argument("--seed", type=int, default=0, help="which held-out prompt")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from longspec.demo import run_demo as demo

    if args.context < 64 or args.new_tokens < 1:
        raise CLIError(f"--context must be >= 64 and --new-tokens >= 1, got {args.context} and {args.new_tokens}")
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: this machine has no CUDA device (torch {torch.__version__})")
    r = demo(args.context, args.new_tokens, args.device, getattr(torch, args.dtype), args.seed)
    print(f"longspec demo: the shipped code pair (target 15.7M parameters + LongSpec draft), {r.device} {r.dtype}")
    print(f"prompt: {r.context} tokens of held-out package {r.package!r} from this machine's standard library; "
          f"{r.new_tokens} new tokens, greedy")
    base = r.results[0].tokens_per_s
    print(f"{'method':36s} {'tau':>5s} {'tokens/s':>9s} {'speedup':>8s}  identical to plain")
    for x in r.results:
        same = "yes" if x.identical else f"NO (from token {x.first_difference})"
        print(f"{x.method:36s} {x.tau:5.2f} {x.tokens_per_s:9.1f} {x.tokens_per_s / base:7.2f}x  {same}")
    print("continuation (plain decoding):\n" + r.continuation)
    return 0 if all(x.identical for x in r.results) else 1


if __name__ == "__main__":
    sys.exit(main())
