"""``longspec demo``: a line per method as it finishes, end-to-end beside decode-only time, and a default prompt
whose continuation reads like code."""
from __future__ import annotations

import io
from collections import Counter

import torch

from longspec import SpeculativeDecoder
from longspec.demo import DEFAULT_SEED, print_demo, run_demo
from longspec.pretrained import heldout_stdlib_prompt, load_code_pair

METHODS = 4


def test_each_method_is_reported_as_it_finishes():
    seen: list = []
    prompts: list = []
    report = run_demo(300, 6, "cpu", torch.float32, seed=0, on_prompt=lambda pkg, n: prompts.append((pkg, n)),
                      on_result=lambda r: seen.append((r, len(prompts))))
    assert prompts == [(report.package, 300)]
    assert [r for r, _ in seen] == report.results and len(seen) == METHODS
    assert all(n_prompts == 1 for _, n_prompts in seen)  # the prompt line comes first
    for r in report.results:
        assert r.identical and r.end_to_end_s > 6 / r.tokens_per_s  # end to end = decoding + the prefill


def test_the_printed_table_has_both_times():
    out = io.StringIO()
    assert print_demo(300, 6, torch.device("cpu"), "float32", seed=0, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("longspec demo: the shipped code pair") and lines[1].startswith("prompt: 300 tokens")
    header, rows = lines[2], lines[3:3 + METHODS]
    assert "decode tok/s" in header and "end-to-end s" in header and "identical to plain" in header
    assert all(row.rstrip().endswith("yes") for row in rows)
    assert [float(row.split()[-2]) > 0 for row in rows] == [True] * METHODS  # the end-to-end seconds


def test_the_default_prompts_continuation_reads_like_code():
    """128 greedy tokens after the default 4096-token prompt: mostly distinct lines, none repeated over and over."""
    pair = load_code_pair("cpu", torch.float32)
    ids, _ = heldout_stdlib_prompt(pair.tokenizer, 4096, seed=DEFAULT_SEED)
    out = SpeculativeDecoder(pair.target, None).generate(ids, 128, eos_token_id=[])
    lines = [line.strip() for line in pair.tokenizer.decode(out.sequences[0, 4096:]).splitlines() if line.strip()]
    assert len(lines) >= 8, lines
    assert len(set(lines)) >= 0.7 * len(lines), lines
    assert max(Counter(lines).values()) <= 2, lines
