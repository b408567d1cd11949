"""The draft's files: reading and loading checkpoints (published drafts, ours, training runs, single weight files)
and the drafting vocabulary on disk (``draft_vocab.json``) with the counts it is chosen from."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from longspec.model.draft_config import LongSpecDraftConfig, check_target_compatible
from longspec.runs import resolve_checkpoint

if TYPE_CHECKING:
    from longspec.model.draft import LongSpecDraft


# --- the drafting vocabulary on disk ----------------------------------------------------------------------------------

DRAFT_VOCAB_FILE = "draft_vocab.json"


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def frequent_tokens(counts: Tensor, size: int) -> Tensor:
    """The ``size`` most frequent token ids (int64, sorted) from per-token counts ``[V]`` (ties: lower id first)."""
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D [V], got shape {tuple(counts.shape)}")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= counts.numel():
        raise ValueError(f"size must be an int in [1, {counts.numel()}], got {size!r}")
    # a stable descending sort keeps the lower id first among equal counts
    order = torch.sort(counts.to(torch.float64).cpu(), descending=True, stable=True).indices
    return torch.sort(order[:size]).values


def count_tokens(batches, vocab_size: int) -> Tensor:
    """int64 ``[vocab_size]`` occurrences of every token id in an iterable of integer tensors (a calibration pass
    over tokenised text, for drafts that ship no drafting vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in batches:
        ids = torch.as_tensor(ids).flatten().to(torch.int64).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def save_draft_vocab(directory: str | os.PathLike, token_ids: Tensor) -> None:
    """Write ``draft_vocab.json`` (the sorted target token ids) into a checkpoint directory."""
    ids = sorted(int(i) for i in torch.as_tensor(token_ids).flatten().tolist())
    (Path(directory) / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": ids}))


def load_draft_vocab(path: str | os.PathLike) -> Tensor:
    """Read a ``draft_vocab.json``: int64 token ids."""
    try:
        data = json.loads(Path(path).read_text())
        ids = data["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a drafting vocabulary (a JSON object with a 'token_ids' list of ints): "
                         f"{err}") from None
    return torch.tensor(ids, dtype=torch.int64)


# --- loading helpers --------------------------------------------------------------------------------------------------

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "draft_model_weights.pth")


def _resolve(name_or_path: str | os.PathLike) -> Path:
    """A local path as is; otherwise a Hub repository id, fetched with huggingface_hub (config and weights only)."""
    path = Path(name_or_path)
    if path.exists():
        return resolve_checkpoint(path)  # a training run directory stands for its latest checkpoint
    if os.path.isabs(str(name_or_path)) or str(name_or_path).count("/") != 1:
        raise FileNotFoundError(f"no draft checkpoint at {name_or_path}")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.pth", "*.pt"]
    return Path(snapshot_download(str(name_or_path), allow_patterns=patterns))


def _weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory (a sharded safetensors index included), or the file itself."""
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    for name in _WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    found = sorted(path.glob("*.safetensors"))
    found = found or sorted(p for ext in ("pth", "pt", "bin") for p in path.glob(f"*.{ext}"))
    if not found:
        raise FileNotFoundError(f"no weights (*.safetensors, *.bin, *.pth, *.pt) in {path}")
    return found


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, on CPU. Pickled files load with ``weights_only=True``: tensors only."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for file in _weight_files(path):
        if file.suffix == ".safetensors":
            part = load_file(str(file), device="cpu")
        else:
            part = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(part, dict) or not all(isinstance(t, Tensor) for t in part.values()):
                raise ValueError(f"{file} is not a state dict of tensors")
        state.update(part)
    return state


def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop the ``model.`` prefix transformers adds for a base model; the same name twice is an error."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare in out:
            raise ValueError(f"checkpoint holds {bare!r} both with and without the 'model.' prefix")
        out[bare] = t
    return out


def _check_state_dict(draft: LongSpecDraft, state: dict[str, Tensor]) -> None:
    """Every expected tensor present, nothing else, and every shape as the geometry requires."""
    expected = {name: tuple(p.shape) for name, p in draft.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing tensors: {', '.join(missing)}"] if missing else []) + (
            [f"unexpected tensors: {', '.join(unexpected)}"] if unexpected else []
        )
        raise ValueError("draft checkpoint does not match LongSpecDraft: " + "; ".join(parts))
    c = draft.config
    geometry = (
        f"hidden {c.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads}, head_dim {c.head_dim}, "
        f"intermediate {c.intermediate_size}"
    )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"draft checkpoint tensor {name} has shape {tuple(state[name].shape)}, expected {shape} ({geometry})"
            )


def load_draft(cls: type[LongSpecDraft], name_or_path: str | os.PathLike, target: torch.nn.Module,
               dtype: torch.dtype | None, device: torch.device | str | None) -> LongSpecDraft:
    """:meth:`LongSpecDraft.from_pretrained` (which says what it reads): the checkpoint's config (or the target's
    geometry), its tensors checked against the geometry, bound to ``target``, with its drafting vocabulary if any."""
    path = _resolve(name_or_path)
    folder = path if path.is_dir() else path.parent
    config_file = folder / "config.json"
    if config_file.is_file():
        config = LongSpecDraftConfig.from_checkpoint_json(json.loads(config_file.read_text()), target.config)
    else:
        config = LongSpecDraftConfig.from_target_config(target.config)
    check_target_compatible(config, target)
    state = _strip_prefix(_read_state_dict(path))
    ref = next(target.parameters())
    with torch.device("meta"):
        draft = cls(config)
    _check_state_dict(draft, state)
    dtype, device = dtype or ref.dtype, device or ref.device
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    draft.load_state_dict(state, strict=True, assign=True)
    draft = draft.eval().bind_target(target)
    vocab_file = folder / DRAFT_VOCAB_FILE
    if vocab_file.is_file():
        draft.set_draft_vocab(load_draft_vocab(vocab_file))
    return draft
