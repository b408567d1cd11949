"""benchmarks/bench_adaptive runs (its CPU smoke mode, as a command: tests never import benchmarks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from longspec.decode.budget import CostModel


def test_adaptive_benchmark_smoke(tmp_path):
    """Every part of the benchmark on tiny sizes: every method's output equals plain decoding at T = 0 and T = 1,
    the adaptive row reports its nodes and predicted tau, and the projection writes a loadable cost model."""
    cmd = [sys.executable, "-m", "benchmarks.bench_adaptive", "--smoke", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[2],
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "LONGSPEC_CACHE_DIR": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "adaptive.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"plain", "PLD chain", "PLD chain 16", "LongSpec tree", "LongSpec chain",
                                           "adaptive LongSpec+PLD"}
    assert {r["T"] for r in rows} == {0.0, 1.0}
    assert all(r["identical_to_plain"] and r["tau"] >= 1.0 for r in rows), rows
    adaptive = [r for r in rows if r["method"] == "adaptive LongSpec+PLD"]
    assert all(r["nodes_per_round"] >= 1 and r["predicted_tau"] >= 1.0 for r in adaptive)
    # the chosen options are counted, each a label whose draft cost the saved calibration holds
    assert all(sum(r["options"].values()) >= 1 for r in adaptive)
    pair_costs = CostModel.load(tmp_path / "pair_costs.json")  # part (a)'s calibration, to replay choices
    # the T = 1 rounds were chosen at sampled costs, calibrated apart from the greedy ones (replay_adaptive needs both)
    sampled = pair_costs.sampled
    assert set(sampled) == {"sampled top_k=0 top_p=1"} and set(sampled["sampled top_k=0 top_p=1"]) == {1}
    assert set(pair_costs.verify) == {1} and all(k.rsplit("/", 1)[0] in pair_costs.draft[1] or k == "plain"
                                                 for r in adaptive for k in r["options"])
    projection = json.loads((tmp_path / "adaptive_projection.json").read_text())["rows"]
    assert len(projection) == 4 and all(r["speedup_fixed69"] > 0 for r in projection)
    costs = CostModel.load(tmp_path / "llama3_8b_costs.json")
    assert set(costs.verify) == {1, 2}
    assert (tmp_path / "adaptive.md").read_text().count("\n| ") == len(rows) + 1
    batched = json.loads((tmp_path / "adaptive_batch.json").read_text())["rows"]  # part (c): B = 2
    assert {r["batch"] for r in batched} == {2} and len(batched) == len(rows)
    assert all(r["identical_to_plain"] and r["tau"] >= 1.0 for r in batched), batched
