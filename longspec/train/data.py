"""Streaming training data: jsonl / plain text / parquet files, tokenised with the target's tokenizer and packed into
fixed-length sequences. Files are read incrementally (never loaded whole); Hugging Face ``datasets`` is used only
for ``hf:`` sources, and only when it is installed.

Packing concatenates documents, each followed by the EOS id, and cuts the stream into ``seq_len`` tokens.

**Sharding by rank.** With K ranks, the local files are one byte space (their sizes in order, from ``stat``, nothing
read) cut into K contiguous ranges, and rank r reads, tokenises and packs only the documents that *start* in range
r: jsonl lines; plain-text lines (a text file is one document; a rank's piece of it ends the document, so at most
two EOS ids per rank and epoch fall inside a file); parquet row groups (by the offset of their first column chunk).
No rank reads what another rank trains on, except the rest of the one line a range boundary cuts (read to find the
next line start), and the parquet footers (metadata). ``hf:`` datasets are split by
``datasets.distributed.split_dataset_by_node``. With one rank the range is everything, in file order.

Each rank's share repeats (epochs) forever, and the trainer decides when to stop. Exact resume:
:meth:`PackedStream.iter_from` skips the sequences this rank already consumed (it re-tokenises its own skipped
text, which is cheap next to a training step).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

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


@dataclass(frozen=True)
class FileRange:
    """Bytes ``[start, end)`` of ``path``: the documents (lines, parquet row groups) that start there are one rank's."""

    path: str
    start: int
    end: int


def shard_ranges(paths: Sequence[str], rank: int = 0, world_size: int = 1) -> list[Optional[FileRange]]:
    """Rank ``rank``'s contiguous ``1 / world_size`` of the byte space the local files make in order, as one entry
    per path: its range of that file, or None (no byte of it is the rank's, or an ``hf:`` source, which is not in
    the byte space). Sizes come from ``stat``; nothing is read."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    sizes = [0 if p.startswith("hf:") else os.path.getsize(p) for p in paths]
    total = sum(sizes)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    out: list[Optional[FileRange]] = []
    base = 0
    for path, size in zip(paths, sizes):
        start, end = max(lo, base) - base, min(hi, base + size) - base
        out.append(FileRange(path, start, end) if start < end else None)
        base += size
    return out


def _lines(r: FileRange) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line with its newline) of every line of ``r.path`` that starts in ``[r.start, r.end)``.

    A line that starts before ``r.start`` belongs to the previous range: its rest is read only to find where the
    next line starts. The last line may run past ``r.end`` (it started inside)."""
    with open(r.path, "rb") as f:
        pos = r.start
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) != b"\n":
                pos += len(f.readline())  # the rest of a line that started in the previous range
        while pos < r.end:
            line = f.readline()
            if not line:
                return
            yield pos, line
            pos += len(line)


def _text(line: bytes, errors: str = "strict") -> str:
    """A line as text mode would read it: UTF-8, universal newlines."""
    return line.decode("utf-8", errors).replace("\r\n", "\n").replace("\r", "\n")


def _iter_jsonl(r: FileRange, key: str) -> Iterator[str]:
    lineno = 0 if r.start == 0 else None  # line numbers are known when reading from the file's start
    for offset, raw in _lines(r):
        where = f"{r.path}:{lineno + 1}" if lineno is not None else f"{r.path} (byte {offset})"
        if lineno is not None:
            lineno += 1
        try:
            line = _text(raw)
        except UnicodeDecodeError as err:
            raise ValueError(f"{where}: not UTF-8 ({err})") from None
        if not line.strip():
            continue
        record = json.loads(line)
        if key not in record:
            raise KeyError(f"{where}: record has no field {key!r} (fields: {sorted(record)[:10]})")
        yield str(record[key])


def _iter_text(r: FileRange) -> Iterator[tuple[str, bool]]:
    """(chunk, last chunk of the document) pairs of this range's lines of a plain-text file, split at line ends.
    The range's last chunk ends a document: the file's end, or this rank's share of it."""
    buf: list[str] = []
    size = 0
    for _, raw in _lines(r):
        line = _text(raw, errors="replace")
        buf.append(line)
        size += len(line)
        if size >= _TEXT_CHUNK_CHARS:
            yield "".join(buf), False
            buf, size = [], 0
    yield "".join(buf), True


def _iter_parquet(r: FileRange, key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {r.path} needs pyarrow: pip install pyarrow") from e
    pf = pq.ParquetFile(r.path)
    if key not in pf.schema_arrow.names:
        raise KeyError(f"{r.path}: parquet file has no column {key!r} (columns: {pf.schema_arrow.names})")
    meta = pf.metadata
    groups = [g for g in range(meta.num_row_groups) if r.start <= _row_group_offset(meta.row_group(g)) < r.end]
    if not groups:
        return
    for batch in pf.iter_batches(columns=[key], batch_size=256, row_groups=groups):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def _row_group_offset(group) -> int:
    """Where a parquet row group's data starts in its file (its first column chunk)."""
    col = group.column(0)
    offsets = [o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None and o > 0]
    return min(offsets) if offsets else col.file_offset


def _iter_hf(spec: str, key: str, split: str, rank: int = 0, world_size: int = 1) -> Iterator[str]:
    # UNTESTED: `datasets` is installed neither in CI nor on the GPU machine; this path has never run.
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"{spec!r} needs the optional package `datasets`") from e
    name = spec[3:]
    ds = datasets.load_from_disk(name) if os.path.isdir(name) else datasets.load_dataset(name, split=split, streaming=True)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split]
    if world_size > 1:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
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


def iter_documents(cfg: DataConfig, rank: int = 0, world_size: int = 1) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) pieces of rank ``rank``'s share (of ``world_size``; see the module docstring), in
    order, once."""
    files = cfg.files()
    for path, r in zip(files, shard_ranges(files, rank, world_size)):
        if path.startswith("hf:"):
            yield from ((t, True) for t in _iter_hf(path, cfg.field, cfg.hf_split, rank, world_size))
            continue
        if r is None:  # no byte of this file is in this rank's range
            continue
        if path.endswith((".jsonl", ".json")):
            yield from ((t, True) for t in _iter_jsonl(r, cfg.field))
        elif path.endswith(".parquet"):
            yield from ((t, True) for t in _iter_parquet(r, cfg.field))
        else:
            yield from _iter_text(r)


class PackedStream:
    """Packed ``seq_len`` token sequences for one rank: ``for ids in stream.iter_from(k)`` yields LongTensor [seq_len].

    tokenizer: a Hugging Face tokenizer (or anything with ``__call__(texts: list[str], add_special_tokens=False)``
        returning ``{"input_ids": list of id lists}``); documents are encoded in batches of about 1M characters.
    eos_id: separator appended after every document (default: the tokenizer's EOS).
    rank, world_size: this rank reads, tokenises and packs only its share of the data (module docstring).
    """

    def __init__(self, cfg: DataConfig, tokenizer, eos_id: int | None = None, rank: int = 0, world_size: int = 1):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos_token_id: pass eos_id to separate documents")
        if cfg.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {cfg.seq_len}")
        self.rank, self.world_size = rank, world_size
        shard_ranges(cfg.files(), rank, world_size)  # fail early on missing files and a bad rank

    def _token_stream(self) -> Iterator[list[int]]:
        while True:
            produced = False
            for pieces in _batched(iter_documents(self.cfg, self.rank, self.world_size), _TOKENIZE_BATCH_CHARS):
                # One call per batch: a fast (Rust) tokenizer encodes the batch on all cores.
                encoded = self.tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
                for ids, (_, ends) in zip(encoded, pieces):
                    if ends:
                        ids = list(ids) + [self.eos_id]
                    if ids:
                        produced = True
                        yield ids
            if not produced:
                share = f"rank {self.rank}'s share (of {self.world_size}) of " if self.world_size > 1 else ""
                hint = "; the data may have fewer documents than ranks" if self.world_size > 1 else ""
                raise ValueError(f"{share}the training data ({self.cfg.paths}) holds no text in field "
                                 f"{self.cfg.field!r}{hint}")

    def iter_from(self, start: int = 0) -> Iterator[torch.Tensor]:
        """This rank's packed sequences, skipping its first ``start`` (for exact resume)."""
        L, buf, index = self.cfg.seq_len, [], 0
        for ids in self._token_stream():
            buf.extend(ids)
            while len(buf) >= L:
                seq, buf = buf[:L], buf[L:]
                if index >= start:
                    yield torch.tensor(seq, dtype=torch.long)
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
