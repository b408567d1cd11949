"""Multi-GPU draft training (issues 8 and 23): the same global batch and seed on 1 and K ranks, DDP and FSDP2.

Runs ``longspec train`` once on one rank (``--batch-size G``) and then under ``torchrun --nproc-per-node K`` with
``--batch-size G/K`` for each K of ``--ranks`` and each parallel mode, on the same data and seed, and compares the
loss curves (overlaid in ``scaling.png``). Each rank reads and tokenises only its own share of the data
(:mod:`longspec.train.data`: a contiguous byte range of the files), so a K-rank step covers G sequences as the
1-rank step does but not the same ones, and anchor offsets and deltas are drawn per rank: curves agree within noise,
not bit for bit. Reports tokens/s per GPU and the scaling efficiency against one GPU. Usage (up to 4 GPUs):
``python -m benchmarks.bench_scaling --target DIR --data FILES --ranks 2 4 --out RESULTS``. On a CPU it runs over
gloo (a smoke test of the same path).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

from benchmarks.harness import write_results


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(target: str, data: list[str], out: str, ranks: int, parallel: str, global_batch: int, steps: int,
        seq_len: int, extra: list[str]) -> list[dict]:
    """One training run; returns its log rows (log.jsonl, every step)."""
    cli = ["-m", "longspec.cli", "train", "--target", target, "--data", *data, "--out", out,
           "--batch-size", str(global_batch // ranks), "--steps", str(steps), "--seq-len", str(seq_len),
           "--parallel", parallel, "--save-every", str(steps), "--log-every", "1", *extra]
    if ranks == 1:
        cmd = [sys.executable, *cli]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(_port()), *cli]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def compare(base: list[dict], other: list[dict], ranks: int) -> dict:
    """Loss-curve agreement and throughput of ``other`` (K ranks) against ``base`` (1 rank)."""
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(base, other)]
    skip = min(3, len(base) - 1)  # the first steps include compilation and warm-up
    tps_1 = statistics.median(r["tokens_per_s"] for r in base[skip:])
    tps_k = statistics.median(r["tokens_per_s"] for r in other[skip:])
    return {"max_abs_loss_diff": max(diffs), "mean_abs_loss_diff": sum(diffs) / len(diffs),
            "final_loss_1": base[-1]["loss"], "final_loss_k": other[-1]["loss"],
            "tokens_per_s_1": tps_1, "tokens_per_s_k": tps_k, "tokens_per_s_per_rank": tps_k / ranks,
            "scaling_efficiency": tps_k / (ranks * tps_1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, nargs="+")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--modes", nargs="+", default=["ddp", "fsdp"])
    ap.add_argument("--work", default="scaling-runs")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/<gpu>/")
    a = ap.parse_args(argv)
    for k in a.ranks:
        if k < 2 or a.global_batch % k:
            raise SystemExit(f"--ranks {k}: each must be >= 2 and divide --global-batch ({a.global_batch})")
    common = (a.target, a.data)
    base = run(*common, os.path.join(a.work, "ranks1"), 1, "none", a.global_batch, a.steps, a.seq_len, [])
    rows, logs = [], {"single": base}
    for k in a.ranks:
        for mode in a.modes:
            log = run(*common, os.path.join(a.work, f"ranks{k}-{mode}"), k, mode, a.global_batch, a.steps,
                      a.seq_len, [])
            logs[f"{mode}-{k}"] = log
            rows.append({"mode": mode, "ranks": k, **compare(base, log, k)})
            print(json.dumps(rows[-1]), flush=True)
    meta = {"global_batch": a.global_batch, "steps": a.steps, "seq_len": a.seq_len}
    write_results("scaling", rows, a.out, meta={**meta, "logs": logs}, title="Draft training on K ranks vs one",
                  notes=["`python -m benchmarks.bench_scaling`: the same global batch and seed on 1 and K ranks; "
                         "each rank reads and tokenises only its share of the data"], plot=_plot_losses(logs),
                  columns=[("mode", "mode", ""), ("ranks", "ranks", ""), ("tokens_per_s_1", "tokens/s, 1 rank", ".0f"),
                           ("tokens_per_s_per_rank", "tokens/s per rank", ".0f"),
                           ("scaling_efficiency", "efficiency", ".2f"), ("mean_abs_loss_diff", "mean |loss diff|", ".3f"),
                           ("final_loss_1", "final loss, 1 rank", ".3f"), ("final_loss_k", "final loss, K", ".3f")])


def _plot_losses(logs: dict[str, list[dict]]):
    """The loss curves of every run, overlaid (``scaling.png``)."""

    def plot(rows: list[dict], path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, log in logs.items():
            ax.plot([r["step"] for r in log], [r["loss"] for r in log], lw=1.2 if name == "single" else 0.8,
                    label="1 rank" if name == "single" else name.replace("-", ", ") + " ranks")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title("Draft training: the same global batch on 1 and K ranks")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    return plot


if __name__ == "__main__":
    main()
