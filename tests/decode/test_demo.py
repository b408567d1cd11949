"""``longspec demo``: a line per method as it finishes, end-to-end beside decode-only time, and a default prompt
whose continuation reads like code."""
from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

from longspec import SpeculativeDecoder
from longspec.demo import DEFAULT_SEED, defaults, print_demo
from longspec.pretrained import heldout_stdlib_prompt, load_code_pair

METHODS = 4
NEW = 6


def test_each_method_is_printed_as_it_finishes(monkeypatch):
    out = io.StringIO()
    rows_printed_at_start: list[int] = []
    generate = SpeculativeDecoder.generate

    def watched(self, *args, **kwargs):  # how many table rows were out when each method started
        rows_printed_at_start.append(out.getvalue().count("\n") - 3)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", watched)
    assert print_demo(300, NEW, torch.device("cpu"), "float32", seed=0, out=out) == 0
    assert rows_printed_at_start == list(range(METHODS))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("longspec demo: the shipped code pair") and lines[1].startswith("prompt: 300 tokens")
    header, rows = lines[2], lines[3:3 + METHODS]
    assert "decode tok/s" in header and "end-to-end s" in header and header.endswith("identical to plain")
    for row in rows:
        *_, tok_s, speedup, end_to_end, same = row.split()
        assert same == "yes" and speedup.endswith("x")
        assert float(end_to_end) > NEW / float(tok_s)  # the whole call: decoding plus the prefill


def test_the_default_prompts_continuation_reads_like_code():
    """128 greedy tokens after the default 4096-token prompt: mostly distinct lines, none repeated over and over."""
    pair = load_code_pair("cpu", torch.float32)
    ids, _ = heldout_stdlib_prompt(pair.tokenizer, 4096, seed=DEFAULT_SEED)
    out = SpeculativeDecoder(pair.target, None).generate(ids, 128, eos_token_id=[])
    lines = [line.strip() for line in pair.tokenizer.decode(out.sequences[0, 4096:]).splitlines() if line.strip()]
    assert len(lines) >= 8, lines
    assert len(set(lines)) >= 0.7 * len(lines), lines
    assert max(Counter(lines).values()) <= 2, lines


def test_defaults_by_device():
    """A CPU gets the short float32 demo; a GPU the 32k bf16 one, with invariant numerics so that every output still
    equals plain decoding's; what is given is kept."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert defaults(cpu) == (4096, "float32", "fast")
    assert defaults(cuda) == (32768, "bfloat16", "invariant")
    assert defaults(cuda, dtype="float32") == (32768, "float32", "fast")
    assert defaults(cpu, 300, "bfloat16") == (300, "bfloat16", "invariant")
    assert defaults(cuda, 8192, "bfloat16", "fast") == (8192, "bfloat16", "fast")


def test_every_method_runs_with_the_numerics_asked_for(monkeypatch):
    """The demo's numerics reach every decoder (plain decoding included, the reference the others must equal), the
    header names them, and an unknown name is refused."""
    from longspec import Numerics
    from longspec.demo import run_demo

    seen = []
    generate = SpeculativeDecoder.generate

    def watched(self, *args, **kwargs):
        seen.append(self.numerics)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", watched)
    out = io.StringIO()
    assert print_demo(300, NEW, torch.device("cpu"), "float32", seed=0, out=out, numerics="invariant") == 0
    assert seen == [Numerics.INVARIANT] * METHODS
    assert "float32, invariant numerics" in out.getvalue().splitlines()[0]
    with pytest.raises(ValueError, match="numerics must be one of"):
        run_demo(300, NEW, "cpu", numerics="exact")
