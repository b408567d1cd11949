"""The ``longspec`` command line: ``longspec generate | train | demo`` (also ``python -m longspec``).

Each subcommand registers itself in :func:`build_parser` with an ``add_<name>_parser`` function and a ``run``
callable taking the parsed arguments and returning an exit code. Arguments are checked by argparse and the files
by :mod:`longspec.inputs` before torch and transformers are imported, and the rest (model type, prompt length,
cache memory) before any weight or cache is allocated. Every bad input ends in one line, ``longspec: error: ...``,
and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from longspec.cli_train import add_train_parser
from longspec.cli_types import DTYPES, float_arg, int_arg
from longspec.inputs import CLIError, TargetFiles, available_memory, check_draft, check_target, read_prompt


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line, like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"longspec: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="longspec", description="Long-context lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(sub)
    add_train_parser(sub)  # longspec.cli_train
    add_demo_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, or a bad argument (already reported in one line)
        return done.code if isinstance(done.code, int) else 2
    try:
        return args.run(args)
    except (CLIError, ValueError, FileNotFoundError) as err:
        print(f"longspec: error: {err}", file=sys.stderr)
        return 2


def _device(name: Optional[str]):
    """The torch.device for ``--device`` (default: cuda when available, else cpu), checked to exist."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise CLIError(f"--device {name!r} is not a device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: this machine has no CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CLIError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


# -- generate -------------------------------------------------------------------------------------------------------


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a local Hugging Face or GGUF model, speculatively",
                       description="Stream a continuation of --prompt-file to stdout; stats go to stderr.")
    p.add_argument("--target", required=True,
                   help="the target model: a local Hugging Face directory, or a .gguf file (needs gguf, accelerate)")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="a LongSpec draft trained for the target (a checkpoint or a training run dir)")
    draft.add_argument("--drafter", choices=("pld", "streaming", "none"), default=None,
                       help="built-in drafter when --draft is not given (default: pld)")
    p.add_argument("--draft-fp8", action="store_true",
                   help="--draft drafts from float8 copies of its weights (half the bytes a level reads; the output "
                        "is unchanged)")
    p.add_argument("--prompt-file", required=True, help="UTF-8 text file holding the prompt ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int_arg(1), default=256)
    p.add_argument("--temperature", type=float_arg(0.0), default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int_arg(0), default=0, help="0 disables")
    p.add_argument("--top-p", type=float_arg(0.0, 1.0, lo_open=True), default=1.0, help="1 disables")
    p.add_argument("--seed", type=int_arg(0, 2**64), default=None,
                   help="seed-exact sampling (speculative output = plain decoding's, token for token)")
    p.add_argument("--tree-shape", type=int_arg(1), nargs="+", default=None,
                   help="nodes per depth (default: 4 16 16 16 16 with --draft, else 1 1 1 1 1)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--cuda-graphs", action="store_true", help="replay every round from CUDA graphs (GPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's layers, the draft step and the round's tail (the first round "
                        "waits for the compile)")
    p.add_argument("--phase-times", action="store_true", help="split the stats line's decode time by phase")
    p.add_argument("--max-cache-len", type=int_arg(1), default=None, help="refuse requests needing more cache rows")
    p.add_argument("--sink", type=int_arg(0), default=32, help="streaming drafter: attention-sink rows")
    p.add_argument("--window", type=int_arg(1), default=1024, help="streaming drafter: recent-window rows")
    p.add_argument("--max-ngram", type=int_arg(1), default=3, help="pld drafter: longest n-gram matched")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    target_files = check_target(args.target)
    if world > 1:
        _check_tensor_parallel_launch(args, target_files, world)
    if args.draft_fp8 and not args.draft:
        raise CLIError("--draft-fp8 needs --draft (it sets how a LongSpec draft reads its weights)")
    draft_path = check_draft(args.draft, target_files) if args.draft else None
    text = read_prompt(args.prompt_file)

    import torch

    from longspec.model.target import check_generation_length

    tokenizer, config = _load_tokenizer_and_config(target_files)
    _check_model_type(config, args.target)
    if world > 1:
        from longspec.model.parallel import check_head_split

        try:
            check_head_split(config, world)
        except ValueError as err:
            raise CLIError(f"--target {args.target!r} under a {world}-process launch: {err}") from None
    prompt_ids = _encode_prompt(tokenizer, text, args.chat)
    try:
        check_generation_length(argparse.Namespace(config=config), prompt_ids.shape[1] + args.max_new_tokens)
    except ValueError as err:
        raise CLIError(f"the prompt is {prompt_ids.shape[1]} tokens and --max-new-tokens {args.max_new_tokens}: "
                       f"{err}") from None
    if world > 1:
        model = _load_model_tensor_parallel(target_files, config, getattr(torch, args.dtype))
        device = model.get_output_embeddings().weight.device
    else:
        device = _device(args.device)
        model = _load_model(target_files, config, getattr(torch, args.dtype), device)
    try:
        return _generate(args, model, tokenizer, prompt_ids, draft_path, device, world)
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _generate(args: argparse.Namespace, model, tokenizer, prompt_ids, draft_path: Optional[Path], device,
              world: int) -> int:
    """Decode and print (every rank of a tensor-parallel launch decodes; rank 0 prints)."""
    from longspec import SpeculativeDecoder

    drafter = _build_drafter(args, model, draft_path)
    tree_shape = args.tree_shape or ((4, 16, 16, 16, 16) if args.draft else (1, 1, 1, 1, 1))
    decoder = SpeculativeDecoder(model, drafter, tree_shape=tree_shape, cuda_graphs=args.cuda_graphs,
                                 compile=args.compile, phase_times=args.phase_times, max_cache_len=args.max_cache_len)
    scratch = decoder.tree.num_nodes if drafter is not None else 1
    _check_cache_fits(model, prompt_ids.shape[1] + args.max_new_tokens + scratch, args.max_cache_len, device, world)
    main_rank = world == 1 or int(os.environ.get("RANK", "0")) == 0
    streamer = _TextStreamer(tokenizer) if main_rank else None
    seed = args.seed
    if world > 1 and args.temperature > 0 and seed is None:
        seed = _shared_random_seed(device)  # every rank must draw the same tokens
    if args.cuda_graphs or args.compile:  # compile and capture before the request, not inside its rounds
        if main_rank:
            print("longspec: warming up (torch.compile, CUDA-graph capture) for this request's size ...",
                  file=sys.stderr, flush=True)
        report = decoder.warmup(batch_sizes=(1,), max_context=prompt_ids.shape[1] + args.max_new_tokens,
                                temperatures=(args.temperature,), top_k=args.top_k, top_p=args.top_p,
                                seeded=seed is not None, progress=main_rank)
        if main_rank:
            print(f"longspec: {report}".splitlines()[0], file=sys.stderr, flush=True)
    out = decoder.generate(prompt_ids.to(device), max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed,
                           streamer=streamer)
    if not main_rank:
        return 0
    print(flush=True)
    _report_stop(out.sequences[0, prompt_ids.shape[1]:].tolist(), args.max_new_tokens, tokenizer, streamer.printed > 0)
    print(out.stats.summary() + (f" tensor-parallel={world}" if world > 1 else ""), file=sys.stderr)
    return 0


def _shared_random_seed(device) -> int:
    """A fresh random seed drawn on rank 0 and broadcast: unseeded sampling, the same on every rank."""
    import torch

    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
    torch.distributed.broadcast(seed, src=0)
    return int(seed)


def _check_tensor_parallel_launch(args: argparse.Namespace, files: TargetFiles, world: int) -> None:
    """What a multi-process (tensor-parallel) launch of ``generate`` cannot take, refused before torch loads."""
    if files.gguf_file:
        raise CLIError(f"--target {args.target!r} is a GGUF file, which is not loaded tensor-parallel: use a Hugging "
                       f"Face directory under a {world}-process launch, or run a single process")
    if args.device is not None:
        raise CLIError(f"--device {args.device}: under a {world}-process launch each rank uses the GPU of its "
                       "LOCAL_RANK (the CPU on a machine without one); leave --device out")


def _load_tokenizer_and_config(files: TargetFiles):
    from transformers import AutoConfig, AutoTokenizer

    kwargs = dict(local_files_only=True, **files.from_pretrained_kwargs())
    try:
        tokenizer = AutoTokenizer.from_pretrained(files.directory, **kwargs)
        config = AutoConfig.from_pretrained(files.directory, **kwargs)
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise CLIError(f"cannot load the tokenizer and config of --target {str(files.directory)!r}: "
                       f"{_first_line(err)}") from None
    return tokenizer, config


def _check_model_type(config, arg: str) -> None:
    from longspec.model.target import SUPPORTED_MODEL_TYPES

    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CLIError(f"--target {arg!r} is a {model_type} model; longspec decodes "
                       f"{', '.join(SUPPORTED_MODEL_TYPES)} models")


def _load_model(files: TargetFiles, config, dtype, device):
    """The target's weights, once every check that needs no weights has passed (``config`` is passed on: a GGUF
    file is then parsed once more for its tensors, not twice)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(files.directory, config=config, dtype=dtype,
                                                     local_files_only=True, **files.from_pretrained_kwargs())
    except Exception as err:  # noqa: BLE001  (safetensors, OSError, ValueError...: all mean "these weights")
        raise CLIError(f"cannot load the weights of --target {str(files.directory)!r}: {_first_line(err)}") from None
    return model.to(device).eval()


def _load_model_tensor_parallel(files: TargetFiles, config, dtype):
    """The target sharded over the launch's ranks with its tensor-parallel plan (each rank reads its shards)."""
    from longspec.model.parallel import load_tensor_parallel

    try:
        return load_tensor_parallel(files.directory, dtype, config=config, local_files_only=True)
    except Exception as err:  # noqa: BLE001  (as _load_model: every failure here means "these weights")
        raise CLIError(f"cannot load the weights of --target {str(files.directory)!r} tensor-parallel: "
                       f"{_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _encode_prompt(tokenizer, text: str, chat: bool):
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise CLIError("--chat: the target's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise CLIError("the prompt is empty after tokenization")
    return ids


def _build_drafter(args: argparse.Namespace, model, draft_path: Optional[Path]):
    import torch

    from longspec import LongSpecDraft, LongSpecDrafter, PromptLookupDrafter, StreamingSelfDrafter

    if draft_path is not None:  # from_pretrained checks the geometry and every tensor against the target
        return LongSpecDrafter(LongSpecDraft.from_pretrained(draft_path, target=model),
                               weight_dtype=torch.float8_e4m3fn if args.draft_fp8 else None)
    builders: dict[str, Callable[[], object]] = {
        "pld": lambda: PromptLookupDrafter(max_ngram=args.max_ngram),
        "streaming": lambda: StreamingSelfDrafter(sink=args.sink, window=args.window),
        "none": lambda: None,
    }
    return builders[args.drafter or "pld"]()


def _check_cache_fits(model, rows: int, max_cache_len: Optional[int], device, world: int = 1) -> None:
    """Refuse, before allocating it, a KV cache larger than the memory ``device`` has free (a tensor-parallel
    rank's cache holds 1 / ``world`` of the KV heads)."""
    from longspec.model.target import head_dim, num_kv_heads

    rows = -(-rows // 256) * 256  # the decoder rounds its cache up to a multiple of 256 rows
    if max_cache_len is not None:
        rows = min(rows, max_cache_len)
    config = model.config
    heads = num_kv_heads(config) // world
    need = config.num_hidden_layers * 2 * rows * heads * head_dim(config) * model.dtype.itemsize
    free = available_memory(device)
    if free is not None and need > free:
        raise CLIError(f"the KV cache ({rows} rows x {config.num_hidden_layers} layers) needs {need / 2**20:.1f} "
                       f"MiB, more than the {free / 2**20:.1f} MiB free on {device}: lower --max-new-tokens or "
                       "shorten the prompt")


def _report_stop(generated: list[int], max_new_tokens: int, tokenizer, printed: bool) -> None:
    """Say on stderr when generation ended at end-of-text rather than at --max-new-tokens."""
    if len(generated) >= max_new_tokens:
        return
    n = len(generated)
    note = ": the first token ended the text, so nothing was printed" if not printed else ""
    print(f"longspec: generation stopped at end-of-text ({tokenizer.convert_ids_to_tokens(generated[-1])!r}, "
          f"id {generated[-1]}) after {n} token{'s' if n != 1 else ''} of --max-new-tokens {max_new_tokens}{note}",
          file=sys.stderr)


class _TextStreamer:
    """Prints row 0's new text after every round (decoding the whole output keeps multi-token characters intact)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens, counts) -> None:
        self.ids.extend(tokens[0, : int(counts[0])].tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        sys.stdout.write(text[self.printed:])
        sys.stdout.flush()
        self.printed = len(text)


# -- demo -----------------------------------------------------------------------------------------------------------


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the shipped trained pair on a held-out long code prompt: plain vs speculative")
    p.add_argument("--context", type=int_arg(64), default=None, help="prompt tokens (default: 4096 on a CPU, 32768 on a GPU)")
    p.add_argument("--new-tokens", type=int_arg(1), default=128)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: float32 on a CPU, bfloat16 on a GPU")
    p.add_argument("--numerics", choices=["fast", "invariant"], default=None,
                   help="the target's kernels (longspec.Numerics): in bfloat16 only 'invariant' keeps every output "
                        "equal to plain decoding's (default: fast in float32, invariant in bfloat16)")
    p.add_argument("--seed", type=int_arg(0), default=None, help="which held-out prompt (default: the demo's own)")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from longspec.demo import defaults, print_demo

    device = _device(args.device)
    context, dtype, numerics = defaults(device, args.context, args.dtype, args.numerics)
    hf_logging.disable_progress_bar()  # the demo prints its own progress, a line per step
    return print_demo(context, args.new_tokens, device, dtype, args.seed, numerics=numerics)


if __name__ == "__main__":
    sys.exit(main())
