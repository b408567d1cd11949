"""``longspec generate`` does what its flags say: sampling flags reach the sampler, a stop at end-of-text is
reported, and the stats line has tokens/s."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

import longspec
from longspec.cli import main

from .conftest import TARGET_FAMILY
from .tiny_targets import tiny_target

NEW = 16
# Each entry changes exactly one sampling flag against its neighbour, and the tests below require every expected
# output to differ from every other: a command that ignored any one flag would print another entry's text.
SAMPLING = {
    "greedy": {},
    "T=1 seed 1": {"temperature": 1.0, "seed": 1},
    "T=1 seed 2": {"temperature": 1.0, "seed": 2},
    "top-k 3": {"temperature": 1.0, "seed": 1, "top_k": 3},
    "top-p 0.5": {"temperature": 1.0, "seed": 1, "top_p": 0.5},
    "T=0.5": {"temperature": 0.5, "seed": 1},
}


def _flags(params: dict) -> list[str]:
    return [x for k, v in params.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def expected(model_dir):
    """Plain decoding's text for each SAMPLING entry, computed by the library (seed-exact: speculative decoding must
    print the same)."""
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    return tok, {name: tok.decode(_plain(tok, params), skip_special_tokens=True) for name, params in SAMPLING.items()}


def _plain(tok, params: dict) -> list[int]:
    ids = tok(" ".join(f"w{3 + (i * 7) % 11}" for i in range(40)), return_tensors="pt")["input_ids"]
    out = longspec.SpeculativeDecoder(tiny_target(TARGET_FAMILY), None).generate(ids, NEW, **params)
    return out.sequences[0, ids.shape[1]:].tolist()


def test_the_expected_outputs_tell_every_flag_apart(expected):
    _, texts = expected
    assert len(set(texts.values())) == len(texts), texts


@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampling_flags_reach_the_sampler(model_dir, prompt_file, capsys, expected, name):
    _, texts = expected
    code, out, err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file),
                         "--dtype", "float32", "--max-new-tokens", str(NEW), "--drafter", "pld",
                         "--tree-shape", "2", "2", *_flags(SAMPLING[name]))
    assert code == 0, err
    assert out == texts[name] + "\n"


def test_stats_line_has_tokens_per_second(model_dir, prompt_file, capsys):
    code, _, err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file),
                       "--dtype", "float32", "--max-new-tokens", "4")
    assert code == 0, err
    stats = err.strip().splitlines()[-1]
    tokens_per_s = float(stats.split("tokens/s=")[1].split()[0])
    assert stats.startswith("rounds=") and "tokens=4 " in stats and tokens_per_s > 0


def test_compile_and_phase_times_flags(model_dir, prompt_file, capsys, expected):
    """--compile runs the compiled round (torch.compile compiles frames) and prints the same text; --phase-times puts
    the draft / verify / accept split in the stats line."""
    import torch

    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    code, out, err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file),
                         "--dtype", "float32", "--max-new-tokens", str(NEW), "--drafter", "pld", "--tree-shape", "2",
                         "2", "--compile", "--phase-times")
    assert code == 0, err
    assert out == expected[1]["greedy"] + "\n"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames
    assert "draft=" in err and "accept=" in err


@pytest.mark.parametrize("stop_at", [0, 5])
def test_a_stop_at_end_of_text_is_reported(model_dir, prompt_file, capsys, expected, tmp_path, stop_at):
    """The model's EOS (a special token of its tokenizer) is made the token greedy decoding emits at index
    ``stop_at``, so generation stops right there."""
    tok, _ = expected
    greedy = _plain(tok, {})
    eos = greedy[stop_at]
    assert eos not in greedy[:stop_at]
    target = tmp_path / "target"
    shutil.copytree(model_dir, target)
    eos_tok = PreTrainedTokenizerFast.from_pretrained(model_dir, eos_token=tok.convert_ids_to_tokens(eos))
    eos_tok.save_pretrained(target)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((target / name).read_text())
        cfg["eos_token_id"] = eos
        (target / name).write_text(json.dumps(cfg))
    code, out, err = run(capsys, "generate", "--target", str(target), "--prompt-file", str(prompt_file),
                         "--dtype", "float32", "--max-new-tokens", str(NEW))
    assert code == 0, err
    assert out == eos_tok.decode(greedy[:stop_at + 1], skip_special_tokens=True) + "\n"
    n = stop_at + 1
    assert f"generation stopped at end-of-text ({eos_tok.eos_token!r}, id {eos}) after {n} token" in err
    assert f"of --max-new-tokens {NEW}" in err
    assert ("the first token ended the text, so nothing was printed" in err) == (stop_at == 0)
    code, _, err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file),
                       "--dtype", "float32", "--max-new-tokens", str(NEW))
    assert code == 0 and "end-of-text" not in err  # the unchanged model runs to --max-new-tokens

