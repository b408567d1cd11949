"""Benchmark session plumbing: the CUDA marker (skipped without a GPU), and one results file set per session.

Results go to ``$LONGSPEC_BENCH_OUT`` (default ``benchmarks/results/<gpu>/``) through
:func:`benchmarks.harness.write_results`: ``<suite>.json``, ``<suite>.md`` and a plot of the timed rows.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from benchmarks.harness import write_results
from longspec.testing import skip_cuda_tests_without_a_gpu


def pytest_collection_modifyitems(config, items):
    skip_cuda_tests_without_a_gpu(items)


_RESULTS: dict[str, list[dict]] = defaultdict(list)
_META: dict[str, dict] = {}


@pytest.fixture(scope="session")
def record():
    """record(suite, row_dict, meta=None): collect one result row; written at session end."""

    def _record(suite: str, row: dict, meta: dict | None = None) -> None:
        if row:
            _RESULTS[suite].append(row)
        if meta:
            _META.setdefault(suite, {}).update(meta)

    return _record


def pytest_sessionfinish(session, exitstatus):
    for suite, rows in _RESULTS.items():
        write_results(suite, rows, meta=_META.get(suite, {}),
                      plot=_plot if any("graph_us" in r for r in rows) else None)


def _plot(rows: list[dict], path: Path) -> None:
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
    ax.set_title(path.stem)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
