"""benchmarks/bench_step_latency's CPU part, ``--merge`` with ``--tree-tau`` (as a command: tests never import
benchmarks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_step_latency", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def _row(tree, round_per_decode):
    return {"model": "m", "context": 32768, "compile": True, "numerics": "fast", "tree": tree, "gpus": 1,
            "decode_us": 100.0, "draft_us": 30.0, "verify_us": 100.0 * round_per_decode - 40.0, "accept_us": 10.0,
            "round_us": 100.0 * round_per_decode, "round_per_decode": round_per_decode,
            "round_reduced_per_decode": round_per_decode - 0.1}


def test_merge_prices_each_tree_per_generated_token(tmp_path):
    """Each row gets its tree's tau over the first tree's and its cost per generated token over the first tree's
    row (reduced round / decode over tau); a tree the tau file lacks gets neither; a missing file is refused."""
    env = {"git_sha": "abc1234", "gpu": "test"}
    for name, rows in (("a", [_row("4-16-16-16-16", 1.6)]), ("b", [_row("4-12-12-12-12", 1.5), _row("2-2", 1.2)])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"environment": env, "meta": {}, "rows": rows}))
    taus = {"meta": {"context": 32768}, "rows": [{"tree": "4-16-16-16-16", "tau_vs_first": 1.0},
                                                 {"tree": "4-12-12-12-12", "tau_vs_first": 0.98}]}
    (tmp_path / "tau.json").write_text(json.dumps(taus))
    out = tmp_path / "out"
    run = _run("--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--tree-tau", str(tmp_path / "tau.json"),
               "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["tree"]: r for r in json.loads((out / "step_latency.json").read_text())["rows"]}
    assert rows["4-16-16-16-16"]["cost_per_token_vs_first"] == pytest.approx(1.0)
    assert rows["4-12-12-12-12"]["tau_vs_first"] == 0.98
    assert rows["4-12-12-12-12"]["cost_per_token_vs_first"] == pytest.approx((1.4 / 1.5) / 0.98)
    assert "tau_vs_first" not in rows["2-2"]
    assert "cost per token / 69-node" in (out / "step_latency.md").read_text()
    missing = _run("--merge", str(tmp_path / "a.json"), "--tree-tau", str(tmp_path / "nope.json"), "--out", str(out))
    assert missing.returncode != 0 and "--tree-tau" in missing.stderr
