"""A Python code corpus from the source installed on this machine, split by top-level package, and held-out
repository-level code-completion prompts (in the manner of LongBench's LCC and RepoBench-P).

Roots are the standard library directory and the site-packages directories. A *package* is an entry directly under
a root: a module file ``name.py`` or a directory ``name/`` (every ``.py`` below it belongs to it). Each package goes
wholly to training or wholly to held-out, decided by a stable hash of its name, so no held-out prompt shares a
package with the training text. Files over 1 MB or not valid UTF-8 are skipped. The corpus is written as
``train.jsonl`` / ``heldout.jsonl`` with one record per file, ``{"package", "path", "text"}``, file by file (the
whole corpus is never in memory); ``path`` is relative to its root and so starts with the package name.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import site
import sysconfig
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

MAX_FILE_BYTES = 1 << 20
# Directory names under a root that are never packages: metadata, caches, and (inside the stdlib dir) the
# site-packages roots, which are walked as roots of their own.
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "lib-dynload", "__phello__"}
_SKIP_SUFFIXES = (".dist-info", ".egg-info", ".data")


def default_roots() -> list[str]:
    """The stdlib directory, then every site-packages directory this interpreter knows (existing, de-duplicated)."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    candidates += list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        candidates.append(user)
    out, seen = [], set()
    for c in candidates:
        real = os.path.realpath(c)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            out.append(real)
    return out


def is_heldout(package: str, heldout_frac: float, salt: str = "longspec") -> bool:
    """Stable across machines and Python runs (sha256, not ``hash()``, which is salted per process)."""
    digest = hashlib.sha256(f"{salt}:{package}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < heldout_frac


def _is_package_entry(root: str, name: str) -> bool:
    # __editable__*: the finder module an editable install (pip install -e) writes, not a package of its own
    if name.startswith((".", "__editable__")) or name in _SKIP_DIRS or name.endswith(_SKIP_SUFFIXES):
        return False
    full = os.path.join(root, name)
    if os.path.isdir(full):
        return not os.path.islink(full)
    return name.endswith(".py") and os.path.isfile(full)


def iter_packages(roots: Sequence[str]) -> Iterator[tuple[str, str, str]]:
    """(package name, root, entry name) for every top-level package, roots in order, names sorted.

    A package name seen in an earlier root shadows later ones (as on ``sys.path``), so no file appears twice.
    """
    seen: set[str] = set()
    for root in roots:
        for name in sorted(os.listdir(root)):
            if not _is_package_entry(root, name):
                continue
            package = name[:-3] if name.endswith(".py") else name
            if package in seen:
                continue
            seen.add(package)
            yield package, root, name


def iter_package_files(root: str, entry: str) -> Iterator[str]:
    """Absolute paths of the package's ``.py`` files in sorted (deterministic) order; symlinked dirs not followed."""
    full = os.path.join(root, entry)
    if os.path.isfile(full):
        yield full
        return
    for dirpath, dirnames, filenames in os.walk(full):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def read_source(path: str) -> str | None:
    """The file's text, or None when it is too big, unreadable or not UTF-8."""
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return None
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


@dataclass
class CorpusStats:
    """What :func:`build_corpus` wrote, per split: packages, files and characters."""

    train_jsonl: str
    heldout_jsonl: str
    packages: dict = field(default_factory=lambda: {"train": 0, "heldout": 0})
    files: dict = field(default_factory=lambda: {"train": 0, "heldout": 0})
    chars: dict = field(default_factory=lambda: {"train": 0, "heldout": 0})
    skipped_files: int = 0


def build_corpus(out_dir: str, roots: Sequence[str] | None = None, heldout_frac: float = 0.1,
                 max_chars: int | None = None, salt: str = "longspec",
                 splits: Sequence[str] = ("train", "heldout")) -> CorpusStats:
    """Write ``out_dir/train.jsonl`` and ``out_dir/heldout.jsonl`` from the Python files under ``roots``.

    roots: directories whose entries are top-level packages (default :func:`default_roots`).
    max_chars: stop after this many characters in all (whole packages are never split across splits either way).
    splits: the splits to fill; packages of the others are skipped unread (their file is left empty).
    Deterministic for a given file tree: packages and files are visited in sorted order.
    """
    if not splits or set(splits) - {"train", "heldout"}:
        raise ValueError(f"splits must be a non-empty subset of ('train', 'heldout'), got {splits!r}")
    os.makedirs(out_dir, exist_ok=True)
    stats = CorpusStats(os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "heldout.jsonl"))
    with open(stats.train_jsonl, "w", encoding="utf-8") as ftrain, \
            open(stats.heldout_jsonl, "w", encoding="utf-8") as fheld:
        for package, root, entry in iter_packages(roots if roots is not None else default_roots()):
            split = "heldout" if is_heldout(package, heldout_frac, salt) else "train"
            if split not in splits:
                continue
            wrote = _write_package(ftrain if split == "train" else fheld, package, root, entry, stats, split)
            stats.packages[split] += int(wrote)
            if max_chars is not None and sum(stats.chars.values()) >= max_chars:
                break
    return stats


def _write_package(f, package: str, root: str, entry: str, stats: CorpusStats, split: str) -> bool:
    wrote = False
    for path in iter_package_files(root, entry):
        text = read_source(path)
        if not text or not text.strip():
            stats.skipped_files += int(text is None)
            continue
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        f.write(json.dumps({"package": package, "path": rel, "text": text}, ensure_ascii=False) + "\n")
        stats.files[split] += 1
        stats.chars[split] += len(text)
        wrote = True
    return wrote


def iter_records(jsonl: str) -> Iterator[dict]:
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


# --- held-out prompts ---------------------------------------------------------------------------------------------


@dataclass
class _FileRef:
    path: str
    offset: int  # byte offset of the record's line in the jsonl
    chars: int


def _index_packages(jsonl: str) -> dict[str, list[_FileRef]]:
    """package -> its files' line offsets (texts are dropped after parsing: only one package is loaded at a time)."""
    index: dict[str, list[_FileRef]] = {}
    with open(jsonl, "rb") as f:
        offset = 0
        for line in f:
            if line.strip():
                rec = json.loads(line)
                index.setdefault(rec["package"], []).append(_FileRef(rec["path"], offset, len(rec["text"])))
            offset += len(line)
    return index


def _read_text(jsonl: str, ref: _FileRef) -> str:
    with open(jsonl, "rb") as f:
        f.seek(ref.offset)
        return json.loads(f.readline())["text"]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def file_header(path: str) -> str:
    """The line that introduces each file in a prompt (the same in training-free evaluation and in prompts)."""
    return f"# file: {path}\n"


def _build_prompt(jsonl: str, files: list[_FileRef], tokenizer, budget: int, prefix: int,
                  rng: random.Random) -> torch.Tensor | None:
    """One prompt of exactly ``budget`` tokens from one package, or None if the package is too small.

    The last ``prefix`` tokens are a newline, the header and the first tokens of a file that has more tokens after them (the
    continuation the model is asked for); the rest is other files of the package, whole, each after its header,
    with the last one cut to fill the budget exactly.
    """
    order = files[:]
    rng.shuffle(order)
    for i, ref in enumerate(order):
        # The leading newline puts the header on a line of its own after a context file cut mid-line.
        head = _encode(tokenizer, "\n" + file_header(ref.path) + _read_text(jsonl, ref))
        if len(head) <= prefix:
            continue  # nothing would be left to continue
        context = _fill_context(jsonl, order[:i] + order[i + 1:], tokenizer, budget - prefix)
        if context is None:
            return None  # the other files cannot fill the budget, whichever one is continued
        return torch.tensor(context + head[:prefix], dtype=torch.long)[None]
    return None


def _fill_context(jsonl: str, files: list[_FileRef], tokenizer, need: int) -> list[int] | None:
    ids: list[int] = []
    for ref in files:
        ids += _encode(tokenizer, file_header(ref.path) + _read_text(jsonl, ref) + "\n")
        if len(ids) >= need:
            return ids[:need]
    return None


PROMPT_KINDS = ("repository", "packages", "skeleton")


def heldout_prompts(heldout_jsonl: str, tokenizer, budget_tokens: int, n: int, seed: int = 0,
                    prefix_tokens: int | None = None, kind: str = "repository") -> tuple[list[torch.Tensor], list[str]]:
    """``n`` code-completion prompts from held-out packages, each LongTensor ``[1, budget_tokens]``: context files,
    each after a ``# file: <relative path>`` line, then the header and first ``prefix_tokens`` tokens (default
    ``max(16, budget_tokens // 16)``, its newline and header included) of a file that goes on after the prompt ends,
    so the model continues a file. ``kind``:

    * ``"repository"``: the context is other files of ONE package (the continued file's). Packages are drawn without
      replacement in a seeded order (one prompt each while enough remain, then again with other files); packages
      with too little text are skipped. Names: the package.
    * ``"packages"``: the context is whole files of SEVERAL packages, taken in turn from each (seeded orders), so no
      one package (the standard library's large ``test``) makes up a long prompt. Names: the packages, ``+``-joined.
    * ``"skeleton"``: as ``"packages"``, but each context file is its :func:`skeleton` (signatures and docstrings, no
      bodies), the continued file's own among them: the continuation is mostly code the prompt does not contain.

    Returns (prompts, names). Raises ValueError if the held-out set cannot give one prompt.
    """
    if kind not in PROMPT_KINDS:
        raise ValueError(f"kind must be one of {PROMPT_KINDS}, got {kind!r}")
    prefix = prefix_tokens if prefix_tokens is not None else max(16, budget_tokens // 16)
    if not 0 < prefix < budget_tokens:
        raise ValueError(f"prefix_tokens ({prefix}) must be in (0, budget_tokens={budget_tokens})")
    rng = random.Random(seed)
    index = _index_packages(heldout_jsonl)
    if kind != "repository":
        return _pooled_prompts(heldout_jsonl, index, tokenizer, budget_tokens, prefix, n, rng, kind == "skeleton")
    # A prompt needs at least budget characters' worth of text (a byte-level BPE token covers >= 1 character).
    candidates = sorted(p for p, fs in index.items() if len(fs) >= 2 and sum(f.chars for f in fs) >= budget_tokens)
    rng.shuffle(candidates)
    prompts, names = [], []
    while len(prompts) < n and candidates:
        usable = []
        for package in candidates:
            if len(prompts) == n:
                break
            ids = _build_prompt(heldout_jsonl, index[package], tokenizer, budget_tokens, prefix, rng)
            if ids is not None:
                prompts.append(ids)
                names.append(package)
                usable.append(package)
        candidates = usable
    if not prompts:
        raise ValueError(f"no held-out package in {heldout_jsonl} has {budget_tokens} tokens over >= 2 files")
    return prompts, names


def skeleton(source: str) -> str | None:
    """A module's outline: its docstring and its classes' and functions' signatures and docstrings (methods kept
    inside their classes, every body else ``...``); None when it does not parse as Python."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def outline(node):
        doc = ast.get_docstring(node, clean=False) if isinstance(node, (ast.Module, *defs)) else None
        keep = [outline(c) for c in node.body if isinstance(c, defs)] if isinstance(node, (ast.Module, ast.ClassDef)) \
            else []
        node.body = ([ast.Expr(ast.Constant(doc))] if doc is not None else []) + keep
        if not node.body and not isinstance(node, ast.Module):
            node.body = [ast.Expr(ast.Constant(...))]
        return node

    return ast.unparse(outline(tree)) + "\n"


def _pooled_prompts(jsonl: str, index: dict[str, list[_FileRef]], tokenizer, budget: int, prefix: int, n: int,
                    rng: random.Random, outlines: bool) -> tuple[list[torch.Tensor], list[str]]:
    """``heldout_prompts`` of the ``"packages"`` and ``"skeleton"`` kinds (``outlines``)."""
    packages = sorted(p for p, fs in index.items() if fs)
    if len(packages) < 2:
        raise ValueError(f"the held-out set {jsonl} has {len(packages)} package(s); pooled prompts need two or more")
    cache: dict[str, str | None] = {}

    def context_text(ref: _FileRef) -> str | None:
        if ref.path not in cache:
            text = _read_text(jsonl, ref)
            cache[ref.path] = skeleton(text) if outlines else text
        return cache[ref.path]

    prompts, names = [], []
    # Continued files: one of each package in turn (packages and their files in seeded orders), so the package
    # with the most files is not the one continued most often.
    turn = rng.sample(packages, len(packages))
    files = {p: rng.sample(index[p], len(index[p])) for p in turn}
    continued = [(p, files[p][i]) for i in range(max(map(len, files.values()))) for p in turn if i < len(files[p])]
    for package, ref in continued:
        if len(prompts) == n:
            break
        head = _encode(tokenizer, "\n" + file_header(ref.path) + _read_text(jsonl, ref))
        if len(head) <= prefix:
            continue  # nothing would be left to continue
        if outlines and context_text(ref) is None:
            continue  # a continued file without an outline is no skeleton prompt
        # Context: the packages in a seeded order, then one file of each in turn (each package's files shuffled);
        # the continued file itself only as an outline, and last, so its signatures stand before its body.
        order = [p for p in packages if p != package]
        rng.shuffle(order)
        queues = {p: rng.sample(index[p], len(index[p])) for p in [package] + order}
        queues[package] = [f for f in queues[package] if f.path != ref.path]
        ids, used, need = [], [], budget - prefix
        own = _encode(tokenizer, "\n" + file_header(ref.path) + context_text(ref)) if outlines else []
        while len(ids) + len(own) < need and any(queues.values()):
            for p in [package] + order:
                if queues[p] and len(ids) + len(own) < need:
                    f = queues[p].pop()
                    text = context_text(f)
                    if text:
                        ids += _encode(tokenizer, file_header(f.path) + text + "\n")
                        used.append(p)
        if len(ids) + len(own) < need:
            continue  # the held-out set cannot fill this budget around this file
        context = (ids[:max(0, need - len(own))] + own)[-need:]
        prompts.append(torch.tensor(context + head[:prefix], dtype=torch.long)[None])
        names.append("+".join(dict.fromkeys([package] + used)))
    if not prompts:
        raise ValueError(f"the held-out set {jsonl} cannot fill {budget} tokens with pooled files")
    return prompts, names
