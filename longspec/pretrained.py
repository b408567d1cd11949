"""The project's own trained target/draft pair, shipped inside the package (``longspec/assets/code-pair``).

A Llama-architecture target (16.3M parameters, 16 layers, hidden 256, 4 query / 2 KV heads, tied embeddings,
rope_theta 1e7, 131072 positions) trained from scratch on the Python source installed on a GPU machine, with a
byte-level BPE tokenizer (vocab 8192), and its LongSpec draft, both in bfloat16 (35 MB in all).
``python -m longspec.recipes.code_pair --scale h200-deep`` made them (``pair.json`` beside the weights summarises
the run; the full record with its loss curves is ``benchmarks/results/h100/recipe_deep.json``). The split into
training and held-out packages is by package name (:func:`longspec.train.corpus.is_heldout`), so held-out prompts
can be rebuilt on any machine from the held-out packages of its own standard library (:func:`heldout_stdlib_prompt`).

Where the pair is after any install (a clone or site-packages): :func:`pair_path`, or from a shell
``python -m longspec.pretrained target`` (``draft``, or nothing for the pair's directory), e.g.
``longspec generate --target "$(python -m longspec.pretrained target)" --draft "$(python -m longspec.pretrained
draft)" --prompt-file F``.
"""
from __future__ import annotations

import json
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

PAIR_DIR = Path(__file__).parent / "assets" / "code-pair"
PARTS = ("target", "draft")


def pair_path(part: Optional[str] = None) -> Path:
    """The installed pair's directory, or its ``"target"`` / ``"draft"`` subdirectory (absolute paths)."""
    if part is not None and part not in PARTS:
        raise ValueError(f"part must be None, 'target' or 'draft', got {part!r}")
    return (PAIR_DIR / part if part else PAIR_DIR).resolve()


@dataclass
class CodePair:
    target: torch.nn.Module  # transformers LlamaForCausalLM, eval mode
    tokenizer: object  # transformers PreTrainedTokenizerFast
    draft: torch.nn.Module  # LongSpecDraft bound to target
    info: dict  # pair.json: how the pair was trained


def load_code_pair(device: Optional[str | torch.device] = None, dtype: Optional[torch.dtype] = None,
                   path: str | Path = PAIR_DIR) -> CodePair:
    """Load the shipped pair on ``device`` (default: cuda when available, else cpu) in ``dtype`` (default
    float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longspec.model.draft import LongSpecDraft

    path = Path(path)
    if not (path / "target" / "config.json").is_file():
        raise FileNotFoundError(f"no trained pair at {path} (expected target/ and draft/ from the recipe's export)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path / "target")
    target = AutoModelForCausalLM.from_pretrained(path / "target", dtype=dtype or torch.float32).to(device).eval()
    draft = LongSpecDraft.from_pretrained(path / "draft", target=target)
    info = json.loads((path / "pair.json").read_text())
    return CodePair(target, tokenizer, draft, info)


def heldout_stdlib_prompt(tokenizer, context: int, seed: int = 0, heldout_frac: float = 0.1,
                          stdlib: Optional[str] = None, kind: str = "repository") -> tuple[torch.Tensor, str]:
    """A completion prompt of exactly ``context`` tokens from the held-out packages of this interpreter's standard
    library (``heldout_frac`` must be the pair's); ``kind`` as :func:`longspec.train.corpus.heldout_prompts`
    (``"repository"``: one package). Returns (int64 ``[1, context]``, its package(s)).

    Raises ValueError when no held-out package here has enough text for ``context`` tokens.
    """
    from longspec.train.corpus import build_corpus, heldout_prompts

    root = stdlib or sysconfig.get_paths()["stdlib"]
    with tempfile.TemporaryDirectory(prefix="longspec-heldout-") as tmp:
        corpus = build_corpus(tmp, roots=[root], heldout_frac=heldout_frac, splits=("heldout",))
        prompts, packages = heldout_prompts(corpus.heldout_jsonl, tokenizer, context, n=1, seed=seed, kind=kind)
    return prompts[0], packages[0]


if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1] not in PARTS):
        sys.exit(f"usage: python -m longspec.pretrained [{' | '.join(PARTS)}]  (prints the shipped pair's path)")
    print(pair_path(sys.argv[1] if len(sys.argv) == 2 else None))
