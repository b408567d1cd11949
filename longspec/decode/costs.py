"""The adaptive budget's cost model: microseconds of a round's verify + tail per node count and of each draft
variant, linear in the committed length, per batch size (and apart for sampled rounds); fitted from timed rounds
(:mod:`~longspec.decode.calibration`) and cached on disk per device and decoder (:func:`cache_path`)."""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

if TYPE_CHECKING:
    from .budget import BudgetOption


@dataclass
class CostModel:
    """Measured costs in microseconds, per batch size, each ``a + b * context`` (context = committed length).

    verify:  ``{batch: {nodes: (a, b)}}``: the target forward over a tree of that many nodes plus the round's tail,
             greedy.
    draft:   ``{batch: {draft_key: (a, b)}}``: growing that pool and pruning it (``"plain"``: the drafters'
             catch-up in a plain round).
    sampled: ``{tail: {batch: {nodes: (a, b)}}}``: as ``verify`` for rounds that sample (``tail``:
             :func:`tail_label` of the sampling settings). Drawing at T > 0 costs more per node than an argmax,
             most at batch > 1: on the H200, shipped pair, 8k, batch 16, a sampled round took 243 us more than a
             greedy one with a 17-node tree and 37 us more with the root alone, so greedy costs would make drafting
             look cheaper than it is there.
    meta:    where the numbers came from (device, model, how measured).
    """

    verify: dict[int, dict[int, tuple[float, float]]] = field(default_factory=dict)
    draft: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    sampled: dict[str, dict[int, dict[int, tuple[float, float]]]] = field(default_factory=dict)

    def verify_table(self, batch: int, tail: Optional[str] = None) -> dict[int, tuple[float, float]]:
        """``{nodes: (a, b)}`` of this batch's greedy (``tail`` None) or sampled rounds (empty when not measured)."""
        return (self.verify if tail is None else self.sampled.get(tail, {})).get(batch, {})

    def covers(self, batch: int, options: Sequence[BudgetOption], tail: Optional[str] = None) -> bool:
        """Whether every option's pieces have a cost at this batch (for rounds with this sampling ``tail``; None:
        greedy)."""
        v, d = self.verify_table(batch, tail), self.draft.get(batch, {})
        return all(o.nodes in v and o.draft_key in d for o in options)

    def verify_us(self, context: float, nodes: int, batch: int, tail: Optional[str] = None) -> float:
        a, b = self.verify_table(batch, tail)[nodes]
        return a + b * context

    def draft_us(self, key: str, context: float, batch: int) -> float:
        a, b = self.draft[batch][key]
        return a + b * context

    def round_us(self, option: BudgetOption, context: float, batch: int, tail: Optional[str] = None) -> float:
        return self.verify_us(context, option.nodes, batch, tail) + self.draft_us(option.draft_key, context, batch)

    def update(self, other: "CostModel") -> "CostModel":
        """Add ``other``'s entries (they win where both have one); returns self."""
        tables = [(self.verify, other.verify), (self.draft, other.draft)]
        tables += [(self.sampled.setdefault(tail, {}), t) for tail, t in other.sampled.items()]
        for mine, theirs in tables:
            for batch, table in theirs.items():
                mine.setdefault(batch, {}).update(table)
        self.meta.update(other.meta)
        return self

    def to_json(self) -> dict:
        def rows(t):
            return {str(b): {str(n): list(c) for n, c in tab.items()} for b, tab in t.items()}

        out = {"verify": rows(self.verify), "draft": rows(self.draft), "meta": self.meta}
        if self.sampled:
            out["sampled"] = {tail: rows(t) for tail, t in self.sampled.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        def rows(t, key=int):
            return {int(b): {key(n): tuple(c) for n, c in tab.items()} for b, tab in t.items()}

        try:
            return cls(rows(data["verify"]), rows(data["draft"], str), dict(data.get("meta", {})),
                       {tail: rows(t) for tail, t in data.get("sampled", {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a cost model (expected 'verify' and 'draft' tables by batch): {e}") from e

    def save(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        return cls.from_json(json.loads(Path(path).read_text()))


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b x`` over ``(x, y)`` points, with ``b >= 0`` and ``a >= 0`` (a cost
    never falls with the context, nor goes below zero); one distinct x gives ``(mean y, 0)``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx > 0 else 0.0
    a = my - b * mx
    if a < 0:  # refit through the origin
        b = max(0.0, sum(x * y for x, y in points) / max(sum(x * x for x in xs), 1e-30))
        a = 0.0
    return a, b


def time_us(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median microseconds of ``fn()`` after one untimed call: CUDA events on a GPU, the wall clock elsewhere."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def cache_path(cache_dir: Optional[str | os.PathLike], key: dict) -> Path:
    """The file a calibration with this key is kept in: ``$LONGSPEC_CACHE_DIR`` (else ``~/.cache/longspec``)
    ``/costs/<hash of the key>.json``."""
    root = Path(cache_dir or os.environ.get("LONGSPEC_CACHE_DIR") or Path.home() / ".cache" / "longspec")
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return root / "costs" / f"{digest}.json"


def tail_label(params) -> Optional[str]:
    """What a round's cost depends on in the sampling settings: None for greedy rounds, else the filters the draws
    apply (top-k, top-p: a top-p draw sorts the vocabulary), e.g. ``"sampled top_k=0 top_p=1"``."""
    return None if params.greedy else f"sampled top_k={params.top_k} top_p={params.top_p:g}"


__all__ = ["CostModel", "cache_path", "fit_line", "tail_label", "time_us"]
