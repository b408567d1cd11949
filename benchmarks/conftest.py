"""Benchmark session plumbing: the CUDA marker from tests/conftest.py, and one results file set per session.

Results go to ``$LONGSPEC_BENCH_OUT`` (default ``benchmarks/results/<gpu>/``) as ``<suite>.json`` and
``<suite>.md`` (plus a plot where the suite draws one), with GPU name, versions and git SHA.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.conftest import pytest_collection_modifyitems, requires_cuda  # noqa: F401  (one marker, one rule)

_RESULTS: dict[str, list[dict]] = defaultdict(list)
_META: dict[str, dict] = {}


def environment() -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    sha = os.environ.get("LONGSPEC_GIT_SHA")  # set by benchmarks/run_gpu.sh callers: the device copy has no .git
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                 cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    import longspec_ops

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_sha": sha,
        "longspec_ops_C": longspec_ops.has_cuda_kernels(),
    }


def out_dir() -> Path:
    if os.environ.get("LONGSPEC_BENCH_OUT"):
        return Path(os.environ["LONGSPEC_BENCH_OUT"])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "", gpu.lower().replace("nvidia", "")) or "gpu"
    return Path(__file__).parent / "results" / slug


@pytest.fixture(scope="session")
def record():
    """record(suite, row_dict, meta=None): collect one result row; written at session end."""

    def _record(suite: str, row: dict, meta: dict | None = None) -> None:
        if row:
            _RESULTS[suite].append(row)
        if meta:
            _META.setdefault(suite, {}).update(meta)

    return _record


def _markdown(suite: str, rows: list[dict], env: dict, meta: dict) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"# {suite}", "", "Environment: " + ", ".join(f"{k} `{v}`" for k, v in env.items()), ""]
    if meta:
        lines += ["Measured in this run: " + ", ".join(f"{k} {v}" for k, v in meta.items()), ""]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session, exitstatus):
    if not _RESULTS:
        return

    env = environment()
    d = out_dir()
    d.mkdir(parents=True, exist_ok=True)
    for suite, rows in _RESULTS.items():
        meta = _META.get(suite, {})
        (d / f"{suite}.json").write_text(json.dumps({"environment": env, "meta": meta, "rows": rows}, indent=1))
        (d / f"{suite}.md").write_text(_markdown(suite, rows, env, meta))
        if any("graph_us" in r for r in rows):
            _plot(suite, rows, d / f"{suite}.png")


def _plot(suite: str, rows: list[dict], path: Path) -> None:
    """Microseconds against context length, one line per method (graphed timings)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["N"], r["graph_us"]) for r in rows if r["method"] == method and r.get("graph_us"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length N")
    ax.set_ylabel("microseconds (CUDA graph replay, median)")
    ax.set_title(suite)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
