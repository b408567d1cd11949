"""Streaming training data: jsonl / plain text / parquet files, tokenised with the target's tokenizer and packed into
fixed-length sequences. Files are read incrementally (never loaded whole); Hugging Face ``datasets`` is used only
for ``hf:`` sources, and only when it is installed.

Packing concatenates documents, each followed by the EOS id, and cuts the stream into ``seq_len`` tokens. Across
ranks, packed sequence i goes to rank ``i % world_size``; the stream repeats its files in order (epochs) forever,
and the trainer decides when to stop. Exact resume: :meth:`PackedStream.iter_from` skips the sequences already
consumed (it re-tokenises the skipped text, which is cheap next to a training step).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

_TEXT_CHUNK_CHARS = 1 << 16  # plain-text files are tokenised in line-aligned chunks of about this size
_TOKENIZE_BATCH_CHARS = 1 << 20  # documents are tokenised in batches of about this many characters


@dataclass
class DataConfig:
    """Where the training text comes from and how it is packed.

    paths: files or glob patterns (``.jsonl``/``.json`` lines, ``.txt``/``.py``/``.md`` plain text, ``.parquet``),
        or ``hf:<name or path>`` for a Hugging Face dataset (needs the optional ``datasets`` package).
    field: the text field of jsonl records / parquet columns / dataset rows.
    seq_len: tokens per packed sequence.
    """

    paths: Sequence[str] = field(default_factory=list)
    field: str = "text"
    seq_len: int = 1024
    hf_split: str = "train"

    def files(self) -> list[str]:
        out: list[str] = []
        for p in self.paths:
            if p.startswith("hf:"):
                out.append(p)
                continue
            matched = sorted(glob.glob(p, recursive=True)) if any(c in p for c in "*?[") else [p]
            matched = [m for m in matched if os.path.isfile(m)]
            if not matched:
                raise FileNotFoundError(f"data path {p!r} matches no file")
            out.extend(matched)
        if not out:
            raise ValueError("DataConfig.paths is empty: give at least one jsonl, text or parquet file")
        return out


def _iter_jsonl(path: str, key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if key not in record:
                raise KeyError(f"{path}:{lineno}: record has no field {key!r} (fields: {sorted(record)[:10]})")
            yield str(record[key])


def _iter_text(path: str) -> Iterator[tuple[str, bool]]:
    """(chunk, last chunk of the document) pairs of one plain-text file, split at line ends."""
    with open(path, encoding="utf-8", errors="replace") as f:
        buf: list[str] = []
        size = 0
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= _TEXT_CHUNK_CHARS:
                yield "".join(buf), False
                buf, size = [], 0
        yield "".join(buf), True


def _iter_parquet(path: str, key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    pf = pq.ParquetFile(path)
    if key not in pf.schema_arrow.names:
        raise KeyError(f"{path}: parquet file has no column {key!r} (columns: {pf.schema_arrow.names})")
    for batch in pf.iter_batches(columns=[key], batch_size=256):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def _iter_hf(spec: str, key: str, split: str) -> Iterator[str]:
    # UNTESTED: `datasets` is installed neither in CI nor on the GPU machine; this path has never run.
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"{spec!r} needs the optional package `datasets`") from e
    name = spec[3:]
    ds = datasets.load_from_disk(name) if os.path.isdir(name) else datasets.load_dataset(name, split=split, streaming=True)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split]
    for row in ds:
        if key not in row:
            raise KeyError(f"{spec}: row has no field {key!r} (fields: {sorted(row)[:10]})")
        yield str(row[key])


def _batched(pieces: Iterator[tuple[str, bool]], max_chars: int) -> Iterator[list[tuple[str, bool]]]:
    """Consecutive pieces grouped until a group holds at least ``max_chars`` characters (the last may hold fewer)."""
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def iter_documents(cfg: DataConfig) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) pieces from every source in order, once."""
    for path in cfg.files():
        if path.startswith("hf:"):
            yield from ((t, True) for t in _iter_hf(path, cfg.field, cfg.hf_split))
        elif path.endswith((".jsonl", ".json")):
            yield from ((t, True) for t in _iter_jsonl(path, cfg.field))
        elif path.endswith(".parquet"):
            yield from ((t, True) for t in _iter_parquet(path, cfg.field))
        else:
            yield from _iter_text(path)


class PackedStream:
    """Packed ``seq_len`` token sequences for one rank: ``for ids in stream.iter_from(k)`` yields LongTensor [seq_len].

    tokenizer: a Hugging Face tokenizer (or anything with ``__call__(texts: list[str], add_special_tokens=False)``
        returning ``{"input_ids": list of id lists}``); documents are encoded in batches of about 1M characters.
    eos_id: separator appended after every document (default: the tokenizer's EOS).
    """

    def __init__(self, cfg: DataConfig, tokenizer, eos_id: int | None = None, rank: int = 0, world_size: int = 1):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id: pass eos_id to separate documents")
        if cfg.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {cfg.seq_len}")
        self.rank, self.world_size = rank, world_size
        cfg.files()  # fail early on missing files

    def _token_stream(self) -> Iterator[list[int]]:
        while True:
            produced = False
            for pieces in _batched(iter_documents(self.cfg), _TOKENIZE_BATCH_CHARS):
                # One call per batch: a fast (Rust) tokenizer encodes the batch on all cores.
                encoded = self.tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
                for ids, (_, ends) in zip(encoded, pieces):
                    if ends:
                        ids = list(ids) + [self.eos_id]
                    if ids:
                        produced = True
                        yield ids
            if not produced:
                raise ValueError(f"the training data ({self.cfg.paths}) holds no text in field {self.cfg.field!r}")

    def iter_from(self, start: int = 0) -> Iterator[torch.Tensor]:
        """This rank's packed sequences, skipping its first ``start`` (for exact resume)."""
        L, buf, index, mine = self.cfg.seq_len, [], 0, 0
        for ids in self._token_stream():
            buf.extend(ids)
            while len(buf) >= L:
                seq, buf = buf[:L], buf[L:]
                if index % self.world_size == self.rank:
                    if mine >= start:
                        yield torch.tensor(seq, dtype=torch.long)
                    mine += 1
                index += 1


def batches(stream: PackedStream, batch_size: int, start_batch: int = 0) -> Iterator[torch.Tensor]:
    """LongTensor [batch_size, seq_len] batches, resuming after ``start_batch`` batches."""
    it = stream.iter_from(start_batch * batch_size)
    while True:
        yield torch.stack([next(it) for _ in range(batch_size)])


class Prefetch:
    """Iterate ``source`` in a background thread, ``depth`` items ahead, in order (tokenisation overlaps the GPU
    step; the Rust tokenizer releases the GIL). An exception in the source is re-raised by ``next``. Call
    :meth:`close` when done (the trainer does): it stops the thread and waits for it, so no thread is left inside
    the tokenizer when the interpreter exits."""

    _END = object()

    def __init__(self, source: Iterator, depth: int = 4):
        import queue
        import threading

        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), daemon=True, name="longspec-prefetch")
        self._thread.start()

    def _put(self, item) -> bool:
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, source: Iterator) -> None:
        try:
            for item in source:
                if not self._put((True, item)):
                    return
            self._put((True, self._END))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put((False, exc))

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        ok, item = self._queue.get()
        if not ok:
            raise item
        if item is self._END:
            self._stop.set()  # later calls stop too
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
