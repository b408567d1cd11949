"""Tile configs, their default tables and the split-KV planning rule of the attention kernels.

What :mod:`.launch` asks before a launch: which :class:`AttnConfig` a shape gets (:func:`split_config`,
:func:`tree_config`), how many KV splits a cache of N rows takes (:func:`plan_splits`, a function of shapes only,
so launches stay CUDA-graph capturable) and how the split merge tiles (:func:`merge_tile`). The measurements behind
each table row are in the comments beside it.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Optional

import torch

# Configs --------------------------------------------------------------------------------------------------------
# A program's fixed cost in the split rule (launch slot, Q load, partial store and its share of the merge),
# expressed in cache rows: ~128 rows plus the workspace traffic of its tile (block_m * D * 8 bytes written and
# read back, against 4 * D bytes per 16-bit K+V row => 2 * block_m rows, added by plan_splits).
_SPLIT_OVERHEAD_ROWS = 128


@dataclass(frozen=True)
class AttnConfig:
    """Launch parameters of one attention launch; every field is a sweep knob for the GPU benchmarks.

    Attributes:
        block_m: packed ``(query, group head)`` rows per program (power of two, >= 16 for ``tl.dot``).
        block_n: KV rows per inner-loop step (power of two, >= 16).
        num_warps, num_stages: Triton launch options of the split kernel.
        occupancy: split-kernel programs expected to co-reside on one SM; the split rule fills
            ``num_sms * occupancy`` slots.
        split_rows: cache rows per KV split (rounded up to ``block_n``); ``None`` lets the shape-only split rule
            choose. Forcing a small value exercises many splits.
        split_overhead_rows: the split rule's fixed cost of one program, in cache rows (:func:`plan_splits`).
        merge_num_warps: warps of the split-merge kernel (its tile follows from the split count: merge_tile).
        tma: load cache blocks by TMA where :func:`tma_eligible` allows it; False: pointer loads. Both are exact
            and gave the same bits on the H200; TMA is 1-4% faster there (paths.md), but the descriptors cost
            ~40 us of host time per eager launch in Triton 3.6's launcher (benchmarks/results/h200/eager.md);
            CUDA graphs pay it once, at capture. (Choosing by capture state instead would compile the TMA kernel
            during capture, after an eager warm-up: the H200 run of 11c4e06 failed that way.)
        pdl: launch the split merge with programmatic dependent launch on sm_90+ GPUs, so it is resident and
            waiting when the split kernel ends; False: a plain launch.
        wgmma: run the split-KV part as the Gluon Hopper kernel (:mod:`.attention_sm90`: async wgmma, softmax
            overlapped with P @ V) where it applies: an sm_90 GPU, fp16/bf16, head dim 64 or 128, one length per
            batch row, TMA-eligible caches, two or more splits. Needs ``block_m = 64`` and ``num_warps = 4``
            (``block_n`` and ``num_stages`` size its K/V ring). Elsewhere the Triton kernel runs this config.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    occupancy: int = 1
    split_rows: Optional[int] = None
    merge_num_warps: int = 4
    split_overhead_rows: int = _SPLIT_OVERHEAD_ROWS
    tma: bool = True
    pdl: bool = True
    wgmma: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"AttnConfig.{name} must be a power of two >= 16, got {value}")
        if self.wgmma and (self.block_m != 64 or self.num_warps != 4 or self.block_n > 128):
            raise ValueError("AttnConfig.wgmma needs block_m = 64, num_warps = 4 and block_n <= 128 (one warpgroup "
                             f"per 64-row tile), got block_m={self.block_m}, num_warps={self.num_warps}, "
                             f"block_n={self.block_n}")
        if self.split_rows is not None and self.split_rows < 1:
            raise ValueError(f"AttnConfig.split_rows must be positive, got {self.split_rows}")


# Tables are scanned in order; the first row with head_dim <= max_d and packed rows (M * G) <= max_rows wins.
# "wide" marks 16-bit inputs (fp16/bf16: tensor cores); float32 runs IEEE dots on FMA units (exact, slow) and needs
# small tiles. Hopper (H200) defaults, to be swept. Offline sm_90 compiles (ptxas, Triton 3.6) of every row below
# show no register spills; registers/smem at D = 128: 16 rows 168 regs 70 KiB, 32 rows 238 regs 76 KiB, 64 rows
# 255 regs 114 KiB, 128 rows (8 warps) 228 regs 132 KiB.
#   * <= 16 rows (decode, M = 1 with G <= 16): memory bound. 3 stages of 128-row K and V blocks (cp.async); swept
#     on the H200 (benchmarks/sweep_attention.py, results/h200/sweep.json): 39.4 us at 32k with the rule's 16 splits,
#     44-52 us with 8 / 32 / 64 forced splits, 39.7-42.8 us with 64-row blocks (repeat runs differ by ~1 us).
#   * 17..64 rows: still mostly bandwidth bound; one warp group.
#   * > 64 rows (tree verification, e.g. 69..74 tokens x G = 4): compute bound at long context (each K/V byte feeds
#     ~300 rows); 128-row tiles run two wgmma warp groups and halve re-reads of K/V across row tiles.
#     The last tile is mostly padding there (296 rows = 2 x 128 + 40). Tried on the H200 and dropped: that tile as a
#     64-row tile, inside the launch (a branch on the program id: 138 vs 132 us at 32k, 449 vs 415 at 128k) or as a
#     second launch with a 4-warp config and its own split plan (143 vs 128 us at 32k). Both were slower.
_INF_ROWS = 1 << 30
_SPLIT_TABLE: tuple[tuple[int, int, bool, AttnConfig], ...] = (
    # max_d, max_rows, wide, config
    (128, 16, True, AttnConfig(block_m=16, block_n=128, num_warps=4, num_stages=3, occupancy=1)),
    (128, 32, True, AttnConfig(block_m=32, block_n=64, num_warps=4, num_stages=3, occupancy=2)),
    (128, 64, True, AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, occupancy=1)),
    (128, _INF_ROWS, True, AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, occupancy=1)),
    (256, 16, True, AttnConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, occupancy=2)),
    (256, 64, True, AttnConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, occupancy=1)),
    (256, _INF_ROWS, True, AttnConfig(block_m=128, block_n=32, num_warps=8, num_stages=2, occupancy=1)),
    (64, _INF_ROWS, False, AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=2, occupancy=2)),
    (256, _INF_ROWS, False, AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, occupancy=2)),
)
# Many rows on an sm_90 GPU (tree verification): the Gluon wgmma kernel. 64-row tiles (296 rows -> 320), 3 stages
# of 64-row K and V blocks: 96 KiB of shared memory and 210-212 registers at D = 128 (offline sm_90 compiles with
# Triton 3.6 / 3.8, tests/ops/test_sm90_kernel.py), so two programs share an SM. Its fixed cost per program is
# larger in the split rule: forced split counts on the H200 (74-token tree, B = 1) preferred one wave of 6 splits at
# 32k (92.0 us, against 95.1 with the split the rule chose at a 128-row overhead and 110.5 with 26) and two waves of
# 13 at 128k (314 us, 331 with 6 or 26; sm90_exploration.json); an overhead of 512 rows selects both.
_SM90_SPLIT = AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, occupancy=2, wgmma=True,
                         split_overhead_rows=512)
# Tree attention alone: at most 256 keys, so a program does a few steps and pipelining depth matters little.
_TREE_TABLE: tuple[tuple[int, int, bool, AttnConfig], ...] = (
    (128, 16, True, AttnConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)),
    (128, 32, True, AttnConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)),
    (128, 64, True, AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
    (128, _INF_ROWS, True, AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)),
    (256, 16, True, AttnConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)),
    (256, 64, True, AttnConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)),
    (256, _INF_ROWS, True, AttnConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)),
    (64, _INF_ROWS, False, AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)),
    (256, _INF_ROWS, False, AttnConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)),
)

# Split rule bounds.
_MAX_SPLITS = 256  # caps the search and the workspace
_MAX_WAVES = 4  # more splits than ~4 waves of programs only adds merge work
_INTERPRETER_SMS = 4  # CPU tensors (Triton interpreter): a nominal SM count, so the split rule still splits



class HybridBackend(enum.Enum):
    """How :func:`hybrid_tree_attn` is computed (a benchmarking choice; both are exact)."""

    FUSED = "fused"  # the tree block is part of the last split of one split-KV launch; the split merge merges it
    COMPOSED = "composed"  # prefix_attn + tree_attn + longspec::merge_attn_states (the paper's composition)


def _pick(table, head_dim: int, rows: int, dtype: torch.dtype) -> AttnConfig:
    wide = dtype in (torch.float16, torch.bfloat16)
    for max_d, max_rows, table_wide, cfg in table:
        if head_dim <= max_d and rows <= max_rows and wide == table_wide:
            return cfg
    raise ValueError(f"longspec kernels: no tile config for head_dim {head_dim} ({dtype}); head dims up to 256")


def split_config(head_dim: int, rows: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> AttnConfig:
    """The default split-KV config for ``rows = M * (Hq // Hkv)`` packed rows (prefix and hybrid attention) on
    ``device`` (None: a device-independent Triton config)."""
    if (device is not None and _capability(device) == (9, 0) and rows > 64 and head_dim in (64, 128)
            and dtype in (torch.float16, torch.bfloat16)):
        return _SM90_SPLIT
    return _pick(_SPLIT_TABLE, head_dim, rows, dtype)


def tree_config(head_dim: int, rows: int, dtype: torch.dtype) -> AttnConfig:
    """The default config of tree attention alone."""
    return _pick(_TREE_TABLE, head_dim, rows, dtype)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: sm_90+ (the interpreter cannot run its PTX)."""
    return _capability(device) >= (9, 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def plan_splits(n_rows: int, base_programs: int, block_m: int, block_n: int, slots: int,
                split_rows: Optional[int] = None, overhead_rows: int = _SPLIT_OVERHEAD_ROWS) -> tuple[int, int]:
    """``(num_splits, split_rows)`` for a cache of ``n_rows`` rows: a function of shapes only (graph-safe).

    ``base_programs`` = B * Hkv * row tiles programs share each split; ``slots`` = SMs x occupancy. Model: all
    programs do equal work, run in waves of ``slots``; minimise waves x (rows per split + fixed cost).
    """
    if n_rows <= 0:
        return 0, block_n
    if split_rows is not None:
        # Keep grid axis 1 within CUDA's 65535 even for a tiny forced split size.
        rows = max(split_rows, _cdiv(n_rows, 65535))
        rows = _cdiv(rows, block_n) * block_n
        return _cdiv(n_rows, rows), rows
    overhead = overhead_rows + 2 * block_m
    max_splits = min(_cdiv(n_rows, block_n), _MAX_SPLITS, max(1, _cdiv(_MAX_WAVES * slots, base_programs)))
    best = None
    for s in range(1, max_splits + 1):
        rows = _cdiv(_cdiv(n_rows, s), block_n) * block_n
        splits = _cdiv(n_rows, rows)
        cost = _cdiv(base_programs * splits, slots) * (rows + overhead)
        if best is None or cost < best[0]:
            best = (cost, splits, rows)
    return best[1], best[2]


_MERGE_TILE_ELEMS = 4096  # float32 elements of one merge step's [rows, splits, D] tile (32 per thread at 4 warps)


def merge_tile(num_splits: int, rows: int, d_pad: int) -> tuple[int, int]:
    """``(BLOCK_S, BLOCK_R)`` of the split merge: up to 32 splits per step, as many rows as the tile then holds."""
    block_s = min(32, _next_pow2(num_splits))
    block_r = max(1, min(_next_pow2(rows), _MERGE_TILE_ELEMS // (block_s * d_pad)))
    return block_s, block_r


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
