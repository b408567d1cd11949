"""The decoder's modes: how the accepted path's K/V reach the cache (:class:`KVUpdate`) and how the target's
forwards round (:class:`Numerics`), with the checks of the combinations a decoder is built with."""
from __future__ import annotations

import enum
from typing import Optional

import torch

from .budget import AdaptiveBudget
from .drafter import Drafter


class KVUpdate(enum.Enum):
    """How the accepted path's K/V reach their committed rows after a verify (both exact; measure, keep the faster).

    COMMIT: ``commit_kv_`` moves the path's rows into place in every layer (one launch for all layers).
    REFEED: only the last layer is compacted (the rows a LongSpec draft reads); the next verify forward re-feeds the
            path ahead of the tree (depth + 1 more query slots), which rewrites those rows in every layer. Between
            rounds the other layers hold valid rows only up to ``seqlens - pending``, so drafters that read them
            (:class:`~longspec.decode.streaming.StreamingSelfDrafter`) need COMMIT.
    """

    COMMIT = enum.auto()
    REFEED = enum.auto()


class Numerics(enum.Enum):
    """How the target's decode and verify forwards round.

    FAST: the fastest kernels (cuBLAS linears, PyTorch norms, split-KV attention sized by the launch). In float32
          speculative output equals plain decoding's; in bf16 a near-tie of the next-token logits may flip, because
          a verify forward (T tokens) and a decode forward (1 token) reduce in different orders.
    INVARIANT: batch-invariant kernels (:mod:`longspec.model.invariant`): one fixed GEMM tiling for every M
          (split-K chosen by N and K only, the partials summed in a fixed order), row-wise RMSNorm, and attention
          split at fixed absolute key positions where each tree node sees exactly the keys decoding would after its
          ancestors are committed. A token's logits inside a verify forward are then bitwise equal to plain
          decoding's (``drafter=None`` in this mode: the reference) for any tree, drafter and batch row, in bf16
          too, so the output equals plain decoding in this mode token for token. The prefill (identical for both)
          stays FAST. ``compile=True`` compiles the target's layers around the invariant ops as in FAST mode;
          Inductor's fused elementwise code (RoPE, SiLU * up, residual adds) rounds differently from eager's, so
          the reference is then plain decoding in this mode *and* compile setting. Cost (H200, bf16, Llama-3-8B,
          32k, ``compile=True``): decode 1.14x, verify 1.42x and a LongSpec round 1.31x the FAST mode's, mostly
          the attention (46 / 131 us per layer at M = 1 / 69 against 38 / 87) and the linears at the verify width
          (``python -m benchmarks.bench_step_latency --numerics both``, ``python -m benchmarks.sweep_invariant``).
          Needs ``KVUpdate.COMMIT`` and a target on one device (no tensor parallelism).
    """

    FAST = enum.auto()
    INVARIANT = enum.auto()


def check_numerics(numerics: Numerics, kv_update: KVUpdate, tp) -> None:
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics must be a Numerics (Numerics.FAST or Numerics.INVARIANT), got {numerics!r}")
    if numerics is Numerics.INVARIANT and kv_update is not KVUpdate.COMMIT:
        raise ValueError("Numerics.INVARIANT needs kv_update=KVUpdate.COMMIT: a re-fed path is attended as new "
                         "tokens, not as the committed rows plain decoding reads")
    if numerics is Numerics.INVARIANT and tp is not None:
        raise ValueError("Numerics.INVARIANT does not support a tensor-parallel target (its sharded linears and "
                         "all-reduces are not batch-invariant)")


def check_settings(prefill_chunk_size: int, budget, drafter: Optional[Drafter]) -> None:
    if isinstance(prefill_chunk_size, bool) or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be an int >= 1, got {prefill_chunk_size!r}")
    if budget is not None and not isinstance(budget, AdaptiveBudget):
        raise TypeError(f"budget must be an AdaptiveBudget or None, got {type(budget).__name__}")
    if budget is not None and drafter is None:
        raise ValueError("budget needs a drafter (plain decoding has no tree to budget)")


def check_drafter(target: torch.nn.Module, drafter: Optional[Drafter], kv_update: KVUpdate) -> None:
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must implement the Drafter protocol (prefill, propose), got {type(drafter).__name__}")
    draft_vocab = getattr(drafter, "vocab_size", None)
    target_vocab = target.get_output_embeddings().out_features
    if draft_vocab is not None and draft_vocab != target_vocab:
        raise ValueError(f"the drafter's vocabulary ({draft_vocab}) differs from the target's ({target_vocab})")
    if not isinstance(kv_update, KVUpdate):
        raise TypeError(f"kv_update must be a KVUpdate, got {kv_update!r}")
    if kv_update is KVUpdate.REFEED and getattr(drafter, "reads_all_target_layers", True) and drafter is not None:
        raise ValueError(f"KVUpdate.REFEED keeps only the target's last layer current between rounds, but "
                         f"{type(drafter).__name__} reads every layer (reads_all_target_layers); use KVUpdate.COMMIT")


__all__ = ["KVUpdate", "Numerics"]
