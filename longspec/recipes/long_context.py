"""The long-context pieces of the code-pair recipe (issue 18): continuing a trained target on long windows with a
rescaled RoPE base, sampling draft data in contiguous blocks, and measuring drafts where long context matters
(held-out next-token loss over long windows, tau on long held-out prompts, steps to an equal held-out loss).

:mod:`longspec.recipes.code_pair` runs them (``--init-target``, stage ``short``); they are plain functions so the
benchmarks and tests can call them on any pair.
"""
from __future__ import annotations

import json
import math
import os
from typing import Sequence

import numpy as np
import torch

Window = tuple[int, int, float]  # (tokens per window, windows per step, share of the run's steps)


# --- RoPE base and windows ----------------------------------------------------------------------------------------


def ntk_rope_theta(theta: float, trained_len: int, new_len: int, head_dim: int) -> float:
    """The RoPE base for extending a model trained on ``trained_len``-token windows to ``new_len`` tokens:
    NTK-aware base scaling, ``theta * s ** (d / (d - 2))`` with ``s = new_len / trained_len`` and ``d = head_dim``.

    Why this base: RoPE pair i turns at ``theta ** (-2i / d)`` radians per token. The highest-frequency pairs (local
    order) complete many turns inside any window and are left almost unchanged; the lowest-frequency pair gets
    exactly ``1 / s`` of its old rate, so at ``new_len`` it has turned no further than it did at ``trained_len``
    during training. Every pair in between is scaled geometrically. The continued training then starts from
    angles the model has seen, instead of having to learn the unseen angles that plain extrapolation would show the
    slow pairs past ``trained_len`` (for theta 1e6 and d 64, half the pairs turn less than once in 8k tokens).
    """
    if trained_len < 1 or new_len < trained_len:
        raise ValueError(f"need 1 <= trained_len <= new_len, got trained_len {trained_len}, new_len {new_len}")
    if head_dim < 4 or head_dim % 2:
        raise ValueError(f"head_dim must be an even number >= 4, got {head_dim}")
    if not (math.isfinite(theta) and theta > 1):
        raise ValueError(f"theta must be a finite number > 1, got {theta}")
    return float(theta * (new_len / trained_len) ** (head_dim / (head_dim - 2)))


def parse_windows(spec: str, name: str = "long_windows") -> tuple[Window, ...]:
    """``"32768x2:0.75,65536x1:0.25"`` -> ((32768, 2, 0.75), (65536, 1, 0.25)): windows of SEQ tokens, BATCH per
    step, for SHARE of the steps, in order. The shares must sum to 1; errors name the field ``name``."""
    out = []
    for part in spec.split(","):
        try:
            size, share = part.strip().split(":")
            seq, batch = size.lower().split("x")
            window = (int(seq), int(batch), float(share))
        except ValueError:
            raise ValueError(f"{name}: expected SEQxBATCH:SHARE[,...] (e.g. 32768x2:0.75,65536x1:0.25), "
                             f"got {part.strip()!r}") from None
        if window[0] < 2 or window[1] < 1 or not 0 < window[2] <= 1:
            raise ValueError(f"{name}: {part.strip()!r} needs SEQ >= 2, BATCH >= 1 and 0 < SHARE <= 1")
        out.append(window)
    if abs(sum(w[2] for w in out) - 1) > 1e-6:
        raise ValueError(f"{name}: the shares must sum to 1, got {sum(w[2] for w in out):g} in {spec!r}")
    return tuple(out)


def phase_steps(windows: Sequence[Window], steps: int) -> list[int]:
    """Steps per window phase: ``round(share * steps)`` for every phase after the first, the rest to the first."""
    later = [int(round(w[2] * steps)) for w in windows[1:]]
    return [max(0, steps - sum(later))] + later


def window_tokens(windows: Sequence[Window], steps: int) -> int:
    """Training tokens of ``steps`` steps over ``windows``."""
    return sum(n * seq * batch for n, (seq, batch, _) in zip(phase_steps(windows, steps), windows))


# --- data ---------------------------------------------------------------------------------------------------------


def block_sample(jsonl: str, out_path: str, want_chars: int, block_chars: int) -> int:
    """About ``want_chars`` characters of ``jsonl`` into ``out_path`` as contiguous blocks of about ``block_chars``
    spread evenly over the file: a record is kept when its start offset falls in the first ``block_chars`` of one of
    the equal segments the file is cut into. The corpus is sorted by package and file, so a block is consecutive
    files of one package (or two): long training windows packed from it hold repository-level context, which a
    stride sample (every k-th file) would break up. Everything is kept when ``want_chars`` covers the file.
    Returns the records written."""
    from longspec.train.corpus import iter_records

    if want_chars < 1 or block_chars < 1:
        raise ValueError(f"want_chars and block_chars must be >= 1, got {want_chars} and {block_chars}")
    total = sum(len(r["text"]) for r in iter_records(jsonl))
    blocks = max(1, math.ceil(want_chars / block_chars))
    segment = total / blocks
    written, offset = 0, 0
    with open(out_path, "w", encoding="utf-8") as f:
        for rec in iter_records(jsonl):
            if want_chars >= total or offset % segment < block_chars:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                written += 1
            offset += len(rec["text"])
    return written


def random_windows(tokens: np.ndarray, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """LongTensor [batch, seq_len]: windows at uniformly drawn offsets (windows may cross document EOS marks)."""
    if tokens.size < seq_len:
        raise ValueError(f"the token file holds {tokens.size} tokens, fewer than seq_len {seq_len}")
    starts = torch.randint(0, tokens.size - seq_len + 1, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s:s + seq_len].astype(np.int64) for s in starts]))


# --- measuring drafts at long context -----------------------------------------------------------------------------


def heldout_windows(tokens: np.ndarray, context: int, windows: int, seed: int, device: torch.device):
    """The ``windows`` held-out windows of ``context`` tokens (``[1, context]`` on ``device``) that
    :func:`draft_heldout_loss` and :func:`target_heldout_loss` score: drawn from ``seed`` and the context alone."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + context)
    for _ in range(windows):
        yield random_windows(tokens, context, 1, gen).to(device)


@torch.no_grad()
def draft_heldout_metrics(draft, target, tokens: np.ndarray, contexts: Sequence[int], windows: int,
                          device: torch.device, delta: int = 1, seed: int = 3, chunk: int = 1024) -> dict[int, dict]:
    """How well ``draft`` predicts held-out windows of each length in ``contexts``, in one pass:
    ``{context: {"ce": .., "kl": .., "top1": ..}}``, means over every position but each window's last.

    Each window runs as at inference: plain positions 0..L-1 (no anchor offset), the target's last-layer K/V of the
    whole window, the draft's cross-attention lagging ``delta`` positions (1: what the re-fed tokens of a round
    see). ``ce``: cross-entropy on the data's next token (the training objective's CE term), so at L = 32k it is
    dominated by positions far past short training windows. ``kl``: KL(target || draft) of the next-token
    distributions (the distillation term). ``top1``: the share of positions where the draft's most likely next token
    is the target's, what a greedy depth-1 draft gets accepted on. The windows are drawn from ``seed`` and the
    context alone, so every draft (and every checkpoint) is scored on the same tokens.
    """
    import torch.nn.functional as F

    from longspec.train.loss import IGNORE_INDEX, token_kl
    from longspec.train.objective import next_token_labels, prepare_target, run_target

    if windows < 1:
        raise ValueError(f"windows must be >= 1, got {windows}")
    prepare_target(target)
    was_training = draft.training
    draft.eval()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    weight = target.get_output_embeddings().weight
    out = {}
    try:
        for ctx in contexts:
            ce, kl, agree, count = (torch.zeros((), dtype=dt, device=device)  # summed on the device: one sync
                                    for dt in (torch.float64, torch.float64, torch.int64, torch.int64))
            for ids in heldout_windows(tokens, ctx, windows, seed, device):
                pos = torch.arange(ctx, device=device)
                with autocast:
                    t = run_target(target, ids, pos)
                    hidden = draft(ids, t.k, t.v, position_ids=pos[None].expand(ids.shape[0], -1), delta=delta)
                    H = hidden.shape[-1]
                    hidden, t_hidden = hidden.reshape(-1, H), t.hidden.reshape(-1, H)
                    labels = next_token_labels(ids).reshape(-1)
                    for s in range(0, labels.shape[0], chunk):  # masks, not boolean indexing: no host sync
                        lab = labels[s:s + chunk]
                        keep = lab != IGNORE_INDEX
                        logq = torch.log_softmax((hidden[s:s + chunk] @ weight.t()).float(), dim=-1)
                        logp = torch.log_softmax((t_hidden[s:s + chunk] @ weight.t()).float(), dim=-1)
                        ce += F.nll_loss(logq, lab, ignore_index=IGNORE_INDEX, reduction="sum")
                        kl += (token_kl(logp, logq) * keep).sum()
                        agree += ((logq.argmax(-1) == logp.argmax(-1)) & keep).sum()
                        count += keep.sum()
            n = int(count)
            out[int(ctx)] = {"ce": float(ce) / n, "kl": float(kl) / n, "top1": int(agree) / n}
    finally:
        draft.train(was_training)
    return out


def draft_heldout_loss(draft, target, tokens: np.ndarray, contexts: Sequence[int], windows: int,
                       device: torch.device, delta: int = 1, seed: int = 3, chunk: int = 1024) -> dict[int, float]:
    """Mean next-token cross-entropy of ``draft`` on held-out windows of each length in ``contexts``:
    ``{context: loss}`` (the ``ce`` of :func:`draft_heldout_metrics`, which says how the windows run)."""
    return {c: m["ce"] for c, m in draft_heldout_metrics(draft, target, tokens, contexts, windows, device, delta, seed,
                                                        chunk).items()}


@torch.no_grad()
def target_heldout_loss(target, tokens: np.ndarray, contexts: Sequence[int], windows: int, device: torch.device,
                        seed: int = 3) -> dict[int, float]:
    """The target's mean next-token cross-entropy on the windows :func:`draft_heldout_loss` scores with the same
    ``seed`` and ``windows`` (``{context: loss}``): the level a draft's loss is compared with."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    out = {}
    for ctx in contexts:
        losses = []
        for ids in heldout_windows(tokens, ctx, windows, seed, device):
            with autocast:
                losses.append(float(target(input_ids=ids, labels=ids).loss))
        out[int(ctx)] = sum(losses) / len(losses)
    return out


@torch.no_grad()
def draft_tau(target, draft, tokenizer, heldout_jsonl: str, contexts: Sequence[int], prompts: int,
              new_tokens: int, tree_shape: Sequence[int] = (4, 16, 16, 16, 16)) -> dict[int, float]:
    """Greedy tau (tokens per target forward) of ``draft`` with ``tree_shape`` on ``prompts`` held-out
    repository-completion prompts of each length in ``contexts`` (the e2e benchmark's prompts: seed = context)."""
    from longspec import LongSpecDrafter, SpeculativeDecoder
    from longspec.train.corpus import heldout_prompts

    device = target.get_output_embeddings().weight.device
    dec = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=tuple(tree_shape))
    out = {}
    for ctx in contexts:
        ids_list, _ = heldout_prompts(heldout_jsonl, tokenizer, ctx, prompts, seed=ctx)
        emitted = forwards = 0
        for ids in ids_list:
            res = dec.generate(ids.to(device), new_tokens, eos_token_id=[])
            emitted += sum(sum(a) for a in res.accept_lengths)
            forwards += sum(len(a) for a in res.accept_lengths)
        out[int(ctx)] = emitted / max(1, forwards)
    return out


def steps_to_equal_loss(curves: dict[str, list[tuple[int, float]]]) -> dict:
    """From held-out loss curves ``{variant: [(step, loss), ...]}`` (steps ascending, every variant evaluated at the
    same steps): the level every variant reaches (the worst final loss), the first evaluated step at which each
    variant is at or below it, and each variant's steps over the fastest one's."""
    if not curves or any(not c for c in curves.values()):
        raise ValueError("every variant needs at least one evaluated step")
    level = max(c[-1][1] for c in curves.values())
    steps = {k: next(step for step, loss in c if loss <= level) for k, c in curves.items()}
    fastest = min(steps.values())
    return {"level": level, "final": {k: c[-1][1] for k, c in curves.items()}, "steps_to_level": steps,
            "steps_over_fastest": {k: v / fastest for k, v in steps.items()}}


def file_sha256(path: str | os.PathLike) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
