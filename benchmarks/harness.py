"""What every benchmark shares: the environment record, where results go, and one results writer.

Each suite writes ``<suite>.json`` (``{"environment", "meta", "rows"}``), ``<suite>.md`` (a title, the environment,
what the run measured of the machine, notes, and a table of the rows) and, where the suite draws one,
``<suite>.png``. The pytest suite (``benchmarks/test_attention.py``, through ``conftest.py``) and every command-line
benchmark call :func:`write_results`; GPU timing is :class:`benchmarks.timing.Timer`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

Column = tuple[str, str, str]  # (row key, header, format spec such as ".1f"; "" for str())


def tree_shape(text: str) -> tuple[int, ...]:
    """A tree shape argument, nodes per depth dash-separated ("4-16-16-16-16") -> ``(4, 16, 16, 16, 16)``; an
    argparse ``type`` (its error names what was expected)."""
    try:
        shape = tuple(int(n) for n in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree is dash-separated node counts per depth, got {text!r}") from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"nodes per depth must be >= 1, got {text!r}")
    return shape


def environment() -> dict:
    """GPU, driver, library versions and the git SHA (``LONGSPEC_GIT_SHA`` where the checkout has no .git)."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    sha = os.environ.get("LONGSPEC_GIT_SHA")
    if not sha:
        root = Path(__file__).resolve().parent.parent
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                                 cwd=root).stdout.strip()
            # sources that differ from HEAD (uncommitted work, or a copied tree whose .git is older than its files,
            # as on the device machine): the commit alone would name code that did not run
            changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *SOURCE_DIRS],
                                     capture_output=True, text=True, check=True, cwd=root).stdout.strip()
            sha += "+wip" if changed else ""
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    import longspec_ops

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "driver": _driver() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_sha": sha,
        "source_sha": source_hash(),
        "longspec_ops_C": longspec_ops.has_cuda_kernels(),
    }


SOURCE_DIRS = ("longspec", "longspec_ops", "csrc", "benchmarks")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".cpp", ".h", ".txt", ".toml")


def source_hash(root: Optional[Path] = None) -> str:
    """A hash of the code that ran (the sources under ``SOURCE_DIRS``, by relative path and content), read from the
    files themselves: unlike ``git_sha`` (the checkout's HEAD, or what ``LONGSPEC_GIT_SHA`` claims) it cannot name a
    stale commit. ``python -m benchmarks.harness`` prints it for the working tree, to match a result against."""
    import hashlib

    root = root or Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for f in sorted((root / d).rglob("*")):
            if f.is_file() and f.suffix in SOURCE_SUFFIXES and "results" not in f.relative_to(root).parts:
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None


def results_dir(out: Optional[str | os.PathLike] = None) -> Path:
    """``out``, else ``$LONGSPEC_BENCH_OUT``, else ``benchmarks/results/<gpu>/`` (``cpu`` without one)."""
    if out:
        return Path(out)
    if os.environ.get("LONGSPEC_BENCH_OUT"):
        return Path(os.environ["LONGSPEC_BENCH_OUT"])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "", gpu.lower().replace("nvidia", "")) or "gpu"
    return Path(__file__).parent / "results" / slug


def markdown(title: str, rows: list[dict], env: dict, meta: Optional[dict] = None, notes: Sequence[str] = (),
             columns: Optional[Sequence[Column]] = None) -> str:
    """The markdown page of a suite: title, environment, meta, notes, then one table row per result row."""
    if columns is None:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        columns = [(k, k, ".1f") for k in keys]
    lines = [f"# {title}", "", "Environment: " + ", ".join(f"{k} `{v}`" for k, v in env.items()), ""]
    if meta:
        lines += ["Measured in this run: " + ", ".join(f"{k} {v}" for k, v in meta.items()), ""]
    for note in notes:
        lines += [note, ""]
    lines += ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _, spec in columns:
            v = r.get(key, "")
            cells.append(format(v, spec) if spec and isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(suite: str, rows: list[dict], out: Optional[str | os.PathLike] = None, *,
                  meta: Optional[dict] = None, title: Optional[str] = None, notes: Sequence[str] = (),
                  columns: Optional[Sequence[Column]] = None,
                  plot: Optional[Callable[[list[dict], Path], None]] = None, env: Optional[dict] = None) -> Path:
    """Write ``<suite>.json``, ``<suite>.md`` and (``plot(rows, path)``) ``<suite>.png`` under
    :func:`results_dir` (``out``); returns the directory. ``env`` (default: this machine's :func:`environment`)
    is for results measured elsewhere, e.g. merged from runs on a GPU machine."""
    d = results_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    (d / f"{suite}.json").write_text(json.dumps({"environment": env, "meta": meta or {}, "rows": rows}, indent=1,
                                                default=str))
    (d / f"{suite}.md").write_text(markdown(title or suite, rows, env, meta, notes, columns))
    if plot is not None and rows:
        plot(rows, d / f"{suite}.png")
    return d


__all__ = ["environment", "markdown", "results_dir", "source_hash", "write_results"]


if __name__ == "__main__":
    print(source_hash())
