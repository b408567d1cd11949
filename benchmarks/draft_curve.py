"""The shipped draft's held-out cross-entropy over its whole training (the first run and every continuation
recorded in a pair's ``pair.json``), against the target's on the same windows: a table and a plot.

Usage: ``python -m benchmarks.draft_curve [--pair DIR] [--out DIR]`` (default: the shipped pair, into
``benchmarks/results/h100``). Nothing is measured here; the points are the recipe's checkpoint scores."""
from __future__ import annotations

import argparse
import json
import os

from longspec.pretrained import pair_path


def lifetime_points(pair: dict) -> list[dict]:
    """One row per scored checkpoint, in training order: ``stage``, cumulative ``step`` and ``tokens``,
    ``windows`` (held-out windows a context), ``draft`` / ``target`` ({context: cross-entropy})."""
    d = pair["draft"]
    rows = [{"stage": "first run", "step": d["steps"], "tokens": d["tokens_seen"], "windows": 16,
             "draft": d["heldout_loss"], "target": d["target_heldout_loss"]}]
    step, tokens = d["steps"], d["tokens_seen"]
    for i, c in enumerate(d.get("continued", []), 1):
        stage = f"continuation {i} ({c['git']}, lr {c['run']['lr']:g}"
        stage += ", KL only)" if c["run"].get("ce_weight", 1.0) == 0 else ")"
        per_step = c["tokens_seen"] / c["steps"]
        if "heldout_loss_16_windows" in c:  # the first continuation recorded only its end points
            rows.append({"stage": stage, "step": step + c["steps"], "tokens": tokens + c["tokens_seen"],
                         "windows": 16, "draft": c["heldout_loss_16_windows"]["after"],
                         "target": d["target_heldout_loss"]})
        else:
            scored = c["heldout_loss_8_windows"]
            for s, losses in scored["curve"]:
                rows.append({"stage": stage, "step": step + s, "tokens": tokens + int(s * per_step), "windows": 8,
                             "draft": losses, "target": scored["target"]})
        step, tokens = step + c["steps"], tokens + c["tokens_seen"]
    return rows


def markdown(rows: list[dict], source: str) -> str:
    contexts = sorted(rows[0]["draft"], key=int)
    lines = [f"# The shipped draft's held-out cross-entropy over its training ({source})", "",
             "Held-out windows of the pair's held-out packages, scored at each saved checkpoint by the recipe "
             "(`longspec.recipes.code_pair`); the target's loss on the same windows beside it. The first run and the "
             "first continuation were scored on 16 windows a context, later ones on 8. Each continuation restarts "
             "its warm-up and cosine schedule. `python -m benchmarks.draft_curve`", "",
             "| stage | step | tokens (M) | windows | " + " | ".join(
                 f"draft {c} | target {c} | gap {c}" for c in contexts) + " |",
             "|---|---|---|---|" + "---|---|---|" * len(contexts)]
    for r in rows:
        cells = [f"{r['draft'][c]:.3f} | {r['target'][c]:.3f} | {r['draft'][c] - r['target'][c]:.3f}"
                 for c in contexts]
        lines.append(f"| {r['stage']} | {r['step']} | {r['tokens'] / 1e6:.0f} | {r['windows']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted(rows[0]["draft"], key=int)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for c in contexts:
        line, = ax.plot([r["tokens"] / 1e6 for r in rows], [r["draft"][c] for r in rows], marker="o", ms=3,
                        label=f"draft, {int(c) // 1024}k")
        ax.plot([r["tokens"] / 1e6 for r in rows], [r["target"][c] for r in rows], ls="--", color=line.get_color(),
                label=f"target, {int(c) // 1024}k")
    ax.set_xlabel("draft training tokens (M)")
    ax.set_ylabel("held-out cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None, help="a pair directory with pair.json (default: the shipped pair)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "h100"))
    a = ap.parse_args(argv)
    path = os.path.join(a.pair, "pair.json") if a.pair else str(pair_path() / "pair.json")
    with open(path) as f:
        rows = lifetime_points(json.load(f))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "draft_curve.md"), "w") as f:
        f.write(markdown(rows, "the shipped pair" if a.pair is None else a.pair))
    plot(rows, os.path.join(a.out, "draft_curve.png"))
    print(markdown(rows, path))


if __name__ == "__main__":
    main()
