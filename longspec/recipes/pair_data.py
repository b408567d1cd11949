"""The code pair recipe's data stage: the corpus split, the tokenizer, tokens on disk, and the recipe's state
(:class:`_Recipe`: paths, timings, the record) that every stage reads (:mod:`longspec.recipes.code_pair`)."""
from __future__ import annotations

import os
import shutil
import time
from typing import Sequence

import numpy as np
import torch

from longspec.recipes.pair_config import Scale, _read_json, _write_json
from longspec.train.corpus import build_corpus, iter_records
from longspec.train.tokenizer import train_bpe_tokenizer

# --- tokens on disk -----------------------------------------------------------------------------------------------


def pretokenize(jsonl: str, tokenizer, out_path: str, max_chars: int | None = None, batch_records: int = 512) -> int:
    """Write the records' token ids, each document followed by EOS, as a flat uint16 file; return the count.

    Batched calls let the Rust tokenizer use every core; records are streamed, never all in memory.
    """
    if len(tokenizer) > 1 << 16:
        raise ValueError("uint16 token files need a vocabulary of at most 65536")
    eos, total, chars, batch = tokenizer.eos_token_id, 0, 0, []
    with open(out_path, "wb") as f:
        for rec in iter_records(jsonl):
            batch.append(rec["text"])
            chars += len(rec["text"])
            if len(batch) == batch_records or (max_chars is not None and chars >= max_chars):
                total += _write_batch(f, tokenizer, batch, eos)
                batch = []
                if max_chars is not None and chars >= max_chars:
                    break
        if batch:
            total += _write_batch(f, tokenizer, batch, eos)
    return total


def _write_batch(f, tokenizer, texts: list[str], eos: int) -> int:
    ids = [x + [eos] for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    flat = np.fromiter((t for doc in ids for t in doc), dtype=np.uint16)
    flat.tofile(f)
    return int(flat.size)


def heldout_chars(s: Scale, long_mode: bool) -> int:
    """Characters of the held-out split to pre-tokenise for evaluation: enough for the longest evaluated window
    (about 4 characters per token, 4 windows' worth) in long-context mode."""
    base = s.eval_windows * s.target_seq * 8
    return max(base, 16 * max(s.eval_contexts + s.draft_eval_contexts)) if long_mode else base


class _Recipe:
    """The state one :func:`run_recipe` call shares between its stages."""

    def __init__(self, out: str, s: Scale, roots, dev: torch.device, init_target: str | None,
                 init_draft: str | None):
        self.out, self.s, self.roots, self.dev = out, s, roots, dev
        self.init_target, self.init_draft = init_target, init_draft
        self.long = init_target is not None
        self.corpus_dir, self.target_dir = os.path.join(out, "corpus"), os.path.join(out, "target")
        self.train_jsonl = os.path.join(self.corpus_dir, "train.jsonl")
        self.heldout_jsonl = os.path.join(self.corpus_dir, "heldout.jsonl")
        self.tokens_file = os.path.join(self.corpus_dir, "train.u16")
        self.held_file = os.path.join(self.corpus_dir, "heldout.u16")
        self.record_path = os.path.join(out, "recipe.json")
        self.record = _read_json(self.record_path)
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        times = self.record.setdefault("wall_s", {})
        times[name] = round(now - self.t, 3)
        self.t = now
        self.record["total_wall_s"] = round(sum(times.values()), 3)
        self.save()

    def save(self) -> None:
        _write_json(self.record_path, self.record)

    def held_tokens(self, tokenizer) -> np.ndarray | None:
        """The held-out token sample (rebuilt when missing, e.g. on a fresh machine); None when it is empty."""
        if not os.path.isfile(self.held_file):
            n = pretokenize(self.heldout_jsonl, tokenizer, self.held_file, max_chars=heldout_chars(self.s, self.long))
            self.record.setdefault("corpus", {})["heldout_tokens_sampled"] = n
        # np.memmap refuses empty files; a tiny corpus may hold out nothing.
        return np.memmap(self.held_file, dtype=np.uint16, mode="r") if os.path.getsize(self.held_file) > 2 else None


def _tokenizer(r: _Recipe):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(r.target_dir)


def _stage_data(r: _Recipe, stages: Sequence[str]) -> None:
    """The corpus (whenever a stage needs it and it is missing), the tokenizer and the token files (stage data)."""
    s, record = r.s, r.record
    corpus_stats = os.path.join(r.corpus_dir, "stats.json")
    if not os.path.isfile(corpus_stats) and set(stages) & {"data", "drafts", "short"}:
        corpus = build_corpus(r.corpus_dir, roots=r.roots, heldout_frac=s.heldout_frac, max_chars=s.corpus_max_chars)
        stats = {"packages": corpus.packages, "files": corpus.files, "chars": corpus.chars,
                 "skipped_files": corpus.skipped_files}
        seen = {k: record["corpus"][k] for k in stats if k in record.get("corpus", {})}
        if seen and seen != {k: stats[k] for k in seen}:
            raise ValueError(f"the rebuilt corpus {stats} differs from the recorded one {seen} (other packages?)")
        _write_json(corpus_stats, stats)
        record["corpus"] = {**record.get("corpus", {}), **stats}
        r.lap("corpus")
    if "data" in stages and not os.path.isfile(os.path.join(r.target_dir, "tokenizer.json")):
        if r.long:  # the init target's own tokenizer: its embeddings are indexed by it
            os.makedirs(r.target_dir, exist_ok=True)
            for name in os.listdir(r.init_target):
                if name.startswith(("tokenizer", "special_tokens")):
                    shutil.copy2(os.path.join(r.init_target, name), r.target_dir)
        else:
            train_bpe_tokenizer([r.train_jsonl], s.vocab_size, r.target_dir, max_chars=s.tokenizer_max_chars)
        r.lap("tokenizer")
    if "data" in stages and "train_tokens" not in record.get("corpus", {}):
        tokenizer = _tokenizer(r)
        record["corpus"]["train_tokens"] = pretokenize(r.train_jsonl, tokenizer, r.tokens_file)
        record["corpus"]["heldout_tokens_sampled"] = pretokenize(r.heldout_jsonl, tokenizer, r.held_file,
                                                                 max_chars=heldout_chars(s, r.long))
        r.lap("pretokenize")
