"""``longspec generate`` on a tiny model and word-level tokenizer saved to a temporary directory."""
from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import longspec
from longspec.cli import build_parser, main

from .tiny_targets import tiny_target


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("drafter", ["pld", "streaming", "none"])
def test_generate_streams_the_greedy_text(model_dir, prompt_file, capsys, drafter):
    code, out, err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file),
                         "--max-new-tokens", "12", "--dtype", "float32", "--drafter", drafter,
                         "--tree-shape", "2", "2")
    assert code == 0, err
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    ids = tok(prompt_file.read_text(), return_tensors="pt")["input_ids"]
    want = tiny_target("llama-gqa-d64").generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1]:]
    assert out == tok.decode(want, skip_special_tokens=True) + "\n"
    assert "tau=" in err and "rounds=" in err


@pytest.mark.parametrize("as_run_dir,fp8", [(False, False), (True, False), (False, True)])
def test_generate_with_a_longspec_draft(model_dir, prompt_file, capsys, tmp_path, as_run_dir, fp8):
    """``--draft DIR``: a saved LongSpec draft (random weights) loads for the target and decodes losslessly; a
    training run directory stands for the checkpoint its ``latest`` pointer names; ``--draft-fp8`` drafts from
    float8 weight copies, with the same output."""
    target = tiny_target("llama-gqa-d64")
    longspec.LongSpecDraft.from_target(target).save_pretrained(tmp_path / "draft" / "checkpoint-7")
    draft = tmp_path / "draft" / "checkpoint-7"
    if as_run_dir:
        (tmp_path / "draft" / "latest").write_text("checkpoint-7")
        draft = tmp_path / "draft"
    code, out, err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file),
                         "--max-new-tokens", "10", "--dtype", "float32", "--draft", str(draft),
                         "--tree-shape", "2", "3", *(["--draft-fp8"] if fp8 else []))
    assert code == 0, err
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    ids = tok(prompt_file.read_text(), return_tensors="pt")["input_ids"]
    want = target.generate(ids, do_sample=False, max_new_tokens=10)[0, ids.shape[1]:]
    assert out == tok.decode(want, skip_special_tokens=True) + "\n"


def test_generate_errors(model_dir, prompt_file, capsys):
    base = ["generate", "--target", str(model_dir), "--prompt-file", str(prompt_file), "--dtype", "float32"]
    code, _, err = run(capsys, *base, "--max-new-tokens", "500")
    assert code == 2 and "exceeds the model's max_position_embeddings (512)" in err
    code, _, err = run(capsys, *base, "--max-new-tokens", "8", "--max-cache-len", "30")
    assert code == 2 and "more than max_cache_len=30" in err
    code, _, err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", "/nonexistent/prompt")
    assert code == 2 and "cannot read --prompt-file" in err


def test_parser_has_subcommands():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([])
    args = parser.parse_args(["generate", "--target", "t", "--prompt-file", "p", "--drafter", "none"])
    assert args.run.__name__ == "run_generate" and args.temperature == 0.0 and args.draft is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--target", "t", "--prompt-file", "p", "--draft", "d", "--drafter", "pld"])


def test_demo_runs_and_outputs_are_identical(capsys):
    from longspec.cli import main

    assert main(["demo", "--context", "300", "--new-tokens", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "the shipped code pair" in out and "300 tokens of held-out package" in out
    assert out.count(" yes") == 4 and " NO" not in out
    assert "fastest here: " in out  # the one-line verdict, from the measured rows
    assert main(["demo", "--context", "8", "--device", "cpu"]) == 2
    assert "longspec: error: argument --context: must be an integer >= 64, got 8" in capsys.readouterr().err
    assert main(["demo", "--context", str(10**8), "--device", "cpu"]) == 2  # more than the held-out stdlib holds
    assert "held-out package" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["demo", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
