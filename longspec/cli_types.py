"""The command line's argument types (argparse reports their errors as ``argument --name: ...``)."""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

DTYPES = ("float32", "float16", "bfloat16")


def int_arg(lo: int, hi: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value >= hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def float_arg(lo: float, hi: float = math.inf, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi):
            bound = f"in ({lo:g}, {hi:g}]" if hi < math.inf else (f"> {lo:g}" if lo_open else f">= {lo:g}")
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse
