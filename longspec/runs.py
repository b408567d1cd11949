"""Training run directories (``longspec train --out DIR``), read without torch.

A run directory holds ``checkpoint-N`` subdirectories, ``log.jsonl``, ``train_config.json`` and a ``latest`` file
naming the newest checkpoint; wherever a draft checkpoint is expected, the run directory stands for that one.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

LATEST = "latest"


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The checkpoint the run's ``latest`` pointer names, or None when there is no pointer.

    Raises FileNotFoundError when the pointer names a checkpoint that is not there.
    """
    pointer = Path(run_dir) / LATEST
    if not pointer.is_file():
        return None
    ckpt = Path(run_dir) / pointer.read_text().strip()
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{pointer} names {ckpt.name!r}, which is not a directory in {run_dir}")
    return ckpt


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself, or its latest checkpoint when ``path`` is a run directory (a ``latest`` pointer, no
    ``config.json`` of its own)."""
    path = Path(path)
    if path.is_dir() and not (path / "config.json").exists():
        return latest_checkpoint(path) or path
    return path


def checkpoint_step(ckpt: Path) -> int:
    """N of a ``checkpoint-N`` directory."""
    match = re.fullmatch(r"checkpoint-(\d+)", ckpt.name)
    if match is None:
        raise ValueError(f"{ckpt} is not named checkpoint-N")
    return int(match.group(1))
