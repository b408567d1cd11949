"""Checks of the command line's files that need neither torch nor transformers.

``longspec generate`` and ``longspec train`` run these before their heavy imports, so a wrong path, a draft given
as the target (or the reverse), a truncated weights file or a binary prompt is reported in well under a second,
in one line naming the argument. Each check raises :class:`CLIError`.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from longspec.runs import resolve_checkpoint

# Files transformers builds a tokenizer from; a model directory without any of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
DRAFT_MODEL_TYPE = "longspec_draft"
# A draft's cross-attention into the target: every LongSpec draft checkpoint has tensors under this prefix.
DRAFT_TENSOR_PREFIX = "cross_attn."
# The geometry a draft shares with its target (the cross-attention reads the target's cache; embeddings and LM head
# are the target's).
SHARED_GEOMETRY = ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is corruption, not metadata


class CLIError(Exception):
    """A user-facing error: printed as ``longspec: error: ...`` with exit code 2."""


@dataclass
class TargetFiles:
    """Where a target model's files are, as transformers' ``from_pretrained`` wants them."""

    directory: Path
    gguf_file: Optional[str]  # the .gguf file's name inside ``directory`` (weights, config and tokenizer in one)
    config: Optional[dict]  # config.json (None for a GGUF target: its config is inside the file)

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def read_json(path: Path, flag: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CLIError(f"{flag}: cannot read {path}: {err}") from err
    if not isinstance(value, dict):
        raise CLIError(f"{flag}: {path} holds a JSON {type(value).__name__}, not an object")
    return value


def safetensors_names(file: Path, flag: str) -> list[str]:
    """The tensor names of a safetensors file, after checking that the file holds every byte its header describes
    (a truncated or corrupt file is refused here, before anything is loaded)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise CLIError(f"{flag}: {file} is truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError) as err:
            raise CLIError(f"{flag}: {file} has a corrupt safetensors header ({err})") from err
    if 8 + n + end != size:
        raise CLIError(f"{flag}: {file} is truncated or corrupt: its header describes {8 + n + end} bytes, "
                       f"the file holds {size}")
    return [k for k in header if k != "__metadata__"]


def weight_files(directory: Path, flag: str) -> list[Path]:
    """The weight files of a model directory (a sharded safetensors index included)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index, flag).get("weight_map", {}).values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing or not shards:
            raise CLIError(f"{flag}: {index} names shards that are not there: {', '.join(missing) or '(none listed)'}")
        return [directory / s for s in shards]
    found = sorted(directory.glob("*.safetensors"))
    found = found or sorted(p for ext in ("bin", "pth", "pt") for p in directory.glob(f"*.{ext}"))
    if not found:
        raise CLIError(f"{flag} {str(directory)!r} holds no weights (*.safetensors, *.bin, *.pth)")
    return found


def tensor_names(directory: Path, flag: str) -> Optional[list[str]]:
    """Every tensor name of a model directory's safetensors weights (checked whole); None for pickled weights,
    which cannot be read without torch."""
    files = weight_files(directory, flag)
    if any(f.suffix != ".safetensors" for f in files):
        return None
    return [name for f in files for name in safetensors_names(f, flag)]


def check_target(arg: str, flag: str = "--target") -> TargetFiles:
    """A target model: a Hugging Face directory (config.json, tokenizer, weights) or a ``.gguf`` file (or a
    directory holding exactly one)."""
    path = Path(arg)
    if not path.exists():
        raise CLIError(f"{flag} {arg!r} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CLIError(f"{flag} {arg!r} is a file; give a model directory (config.json, tokenizer, weights) "
                           "or a .gguf file")
        return _gguf_target(path, flag)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_target(ggufs[0], flag)
        if ggufs:
            raise CLIError(f"{flag} {arg!r} holds {len(ggufs)} .gguf files; name the one to use")
        if (path / "latest").is_file():
            raise CLIError(f"{flag} {arg!r} is a training run directory (it holds a draft): give it as --draft")
        raise CLIError(f"{flag} {arg!r} has no config.json: not a Hugging Face model directory")
    config = read_json(path / "config.json", flag)
    if config.get("model_type") == DRAFT_MODEL_TYPE:
        raise CLIError(f"{flag} {arg!r} is a LongSpec draft (config.json model_type {DRAFT_MODEL_TYPE!r}), not a "
                       "target model: give it as --draft, and the model it drafts for as --target")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CLIError(f"{flag} {arg!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}): longspec reads the "
                       "prompt with the target's tokenizer")
    tensor_names(path, flag)
    return TargetFiles(path, None, config)


def _gguf_target(file: Path, flag: str) -> TargetFiles:
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CLIError(f"{flag} {str(file)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    missing = [m for m in ("gguf", "accelerate") if _find_spec(m) is None]
    if missing:
        raise CLIError(f"{flag} {str(file)!r}: a GGUF target needs the {' and '.join(missing)} package"
                       f"{'s' if len(missing) > 1 else ''} (pip install {' '.join(missing)})")
    return TargetFiles(file.parent, file.name, None)


def _find_spec(module: str):
    import importlib.util

    return importlib.util.find_spec(module)


def check_draft(arg: str, target: TargetFiles, flag: str = "--draft") -> Path:
    """A LongSpec draft checkpoint (or a training run directory: its latest checkpoint) that fits ``target``.
    Returns the checkpoint path."""
    path = Path(arg)
    if not path.exists():
        raise CLIError(f"{flag} {arg!r} does not exist")
    try:
        path = resolve_checkpoint(path)
    except FileNotFoundError as err:
        raise CLIError(f"{flag} {arg!r}: {err}") from err
    directory = path if path.is_dir() else path.parent
    names = tensor_names(path, flag) if path.is_dir() else (
        safetensors_names(path, flag) if path.suffix == ".safetensors" else None)
    config = read_json(directory / "config.json", flag) if (directory / "config.json").is_file() else None
    if names is not None and not any(n.removeprefix("model.").startswith(DRAFT_TENSOR_PREFIX) for n in names):
        kind = f"; it looks like a {config['model_type']} model (give it as --target)" if config and \
            config.get("model_type") not in (None, DRAFT_MODEL_TYPE) else ""
        example = f" (e.g. {names[0]!r})" if names else ""
        raise CLIError(f"{flag} {arg!r} is not a LongSpec draft: its {len(names)} tensors{example} include no "
                       f"{DRAFT_TENSOR_PREFIX}* (the draft's cross-attention into the target){kind}")
    if config is not None and target.config is not None:
        for key in SHARED_GEOMETRY:
            mine, theirs = _geometry(config, key), _geometry(target.config, key)
            if mine is not None and theirs is not None and mine != theirs:
                raise CLIError(f"{flag} {arg!r} does not fit --target: the draft's {key} is {mine}, the target's "
                               f"{theirs}")
    return path


def _geometry(config: dict, key: str):
    if key == "num_key_value_heads":
        return config.get(key) or config.get("num_attention_heads")
    return config.get(key)


def read_prompt(arg: str, flag: str = "--prompt-file") -> str:
    """The prompt text of a file ('-' = standard input): it must be non-empty UTF-8 text."""
    if arg == "-":
        data, name = sys.stdin.buffer.read(), "(standard input)"
    else:
        name = repr(arg)
        if os.path.isdir(arg):
            raise CLIError(f"{flag} {name} is a directory, not a text file")
        try:
            data = Path(arg).read_bytes()
        except OSError as err:
            raise CLIError(f"cannot read {flag} {name}: {err.strerror}") from err
    if not data:
        raise CLIError(f"{flag} {name} is empty")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise CLIError(f"{flag} {name} is not text: it holds a NUL byte at offset {nul}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CLIError(f"{flag} {name} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start}") from err


def available_memory(device) -> Optional[int]:
    """Bytes that can still be allocated on ``device`` (a torch.device): CUDA's free memory, or the host's
    MemAvailable on Linux; None when unknown."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
