"""Bad input to ``longspec generate`` ends in one line, ``longspec: error: ...`` naming the argument, and exit code 2.

File and argument checks run before torch and transformers are imported (checked in a fresh interpreter); the
checks that need the tokenizer or the config run before any weight is loaded, and the cache check before the
decoder allocates.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import longspec
from longspec import cli

from .conftest import TARGET_FAMILY, save_word_tokenizer
from .tiny_targets import VOCAB, tiny_target

# Runs the command in a fresh interpreter and reports which heavy modules it imported.
_FRESH = textwrap.dedent("""
    import sys
    from longspec.cli import main
    code = main(sys.argv[1:])
    print("imported:", *sorted(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr)
    sys.exit(code)
""")


def fresh(*argv: str) -> tuple[int, str, list[str]]:
    """(exit code, the error line, heavy modules imported) of ``longspec ARGV`` in a new interpreter."""
    run = subprocess.run([sys.executable, "-c", _FRESH, *argv], capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    imported = lines[-1].split()[1:]
    return run.returncode, "\n".join(lines[:-1]), imported


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    longspec.LongSpecDraft.from_target(tiny_target(TARGET_FAMILY)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, model_dir, draft_dir):
    """Broken copies of the good inputs, one per case."""
    root = tmp_path_factory.mktemp("bad")
    truncated = root / "truncated-target"
    shutil.copytree(model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    bad_header = root / "bad-header-draft"
    shutil.copytree(draft_dir, bad_header)
    (bad_header / "model.safetensors").write_bytes((40).to_bytes(8, "little") + b"{not json" + b" " * 40)
    no_tokenizer = root / "no-tokenizer"
    tiny_target(TARGET_FAMILY).save_pretrained(no_tokenizer)
    other_draft = root / "other-draft"  # a draft made for a target with 2 query heads, not 4
    longspec.LongSpecDraft.from_target(tiny_target("qwen2-mha-d128")).save_pretrained(other_draft)
    (root / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(128, 256)))
    (root / "nul.txt").write_bytes(b"w3 w4\x00w5")
    (root / "empty.txt").write_bytes(b"")
    (root / "fake.gguf").write_bytes(b"not a gguf file")
    (root / "weights.bin").write_bytes(b"\x00" * 16)
    return root


def _cases(model_dir, draft_dir, files, prompt):
    t, d = str(model_dir), str(draft_dir)
    return {
        "target missing": (["--target", str(files / "none"), "--prompt-file", prompt],
                           f"--target '{files / 'none'}' does not exist"),
        "draft missing": (["--target", t, "--draft", str(files / "none"), "--prompt-file", prompt],
                          f"--draft '{files / 'none'}' does not exist"),
        "target is a draft": (["--target", d, "--prompt-file", prompt],
                              f"--target {d!r} is a LongSpec draft (config.json model_type 'longspec_draft'), not a "
                              "target model: give it as --draft"),
        "draft is a target": (["--target", t, "--draft", t, "--prompt-file", prompt],
                              f"--draft {t!r} is not a LongSpec draft: its "),
        "target truncated": (["--target", str(files / "truncated-target"), "--prompt-file", prompt],
                             "is truncated or corrupt: its header describes"),
        "draft header": (["--target", t, "--draft", str(files / "bad-header-draft"), "--prompt-file", prompt],
                         "has a corrupt safetensors header"),
        "no tokenizer": (["--target", str(files / "no-tokenizer"), "--prompt-file", prompt],
                         "has no tokenizer (tokenizer.json, tokenizer.model, vocab.json, spiece.model)"),
        "draft for another target": (["--target", t, "--draft", str(files / "other-draft"), "--prompt-file", prompt],
                                     "does not fit --target: the draft's num_attention_heads is 2, the target's 4"),
        "not a gguf": (["--target", str(files / "fake.gguf"), "--prompt-file", prompt],
                       "is not a GGUF file (it starts with b'not ', not b'GGUF')"),
        "target a file": (["--target", str(files / "weights.bin"), "--prompt-file", prompt],
                          "is a file; give a model directory"),
        "binary prompt": (["--target", t, "--prompt-file", str(files / "binary.txt")],
                          f"--prompt-file '{files / 'binary.txt'}' is not UTF-8 text: byte 0x89 at offset 0"),
        "NUL in prompt": (["--target", t, "--prompt-file", str(files / "nul.txt")],
                          f"--prompt-file '{files / 'nul.txt'}' is not text: it holds a NUL byte at offset 5"),
        "empty prompt": (["--target", t, "--prompt-file", str(files / "empty.txt")], "is empty"),
        "prompt is a directory": (["--target", t, "--prompt-file", str(files)], "is a directory, not a text file"),
        "unreadable prompt": (["--target", t, "--prompt-file", str(files / "none.txt")], "cannot read --prompt-file"),
        "top-p": (["--target", t, "--prompt-file", prompt, "--top-p", "1.5"],
                  "argument --top-p: must be a finite number in (0, 1], got 1.5"),
        "temperature": (["--target", t, "--prompt-file", prompt, "--temperature", "-1"],
                        "argument --temperature: must be a finite number >= 0, got -1"),
        "temperature nan": (["--target", t, "--prompt-file", prompt, "--temperature", "nan"],
                            "argument --temperature: must be a finite number >= 0, got nan"),
        "max-new-tokens": (["--target", t, "--prompt-file", prompt, "--max-new-tokens", "0"],
                           "argument --max-new-tokens: must be an integer >= 1, got 0"),
        "top-k": (["--target", t, "--prompt-file", prompt, "--top-k", "x"],
                  "argument --top-k: expected an integer, got 'x'"),
        "seed": (["--target", t, "--prompt-file", prompt, "--seed", str(2**64)],
                 f"argument --seed: must be an integer in [0, {2**64}), got {2**64}"),
        "tree shape": (["--target", t, "--prompt-file", prompt, "--tree-shape", "4", "0"],
                       "argument --tree-shape: must be an integer >= 1, got 0"),
        "draft-fp8 without a draft": (["--target", t, "--prompt-file", prompt, "--draft-fp8"],
                                      "--draft-fp8 needs --draft"),
    }


CASES = list(_cases("t", "d", Path("f"), "p"))  # the names, for parametrize


@pytest.mark.parametrize("case", CASES)
def test_bad_files_and_arguments_fail_before_heavy_imports(model_dir, draft_dir, files, prompt_file, case):
    argv, message = _cases(model_dir, draft_dir, files, str(prompt_file))[case]
    code, err, imported = fresh("generate", *argv)
    assert code == 2, err
    assert err.startswith("longspec: error: ") and "\n" not in err, err
    assert message in err, err
    assert len(err) < 400, err  # a line, not a list of every tensor name
    assert imported == [], f"{case}: imported {imported} before the check"


def test_help_and_python_m_need_no_heavy_imports():
    code, err, imported = fresh("--help")
    assert code == 0 and imported == [], (err, imported)
    run = subprocess.run([sys.executable, "-m", "longspec", "generate", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "--prompt-file" in run.stdout and "--temperature" in run.stdout


# -- checks after the imports, before the weights / before the cache ---------------------------------------------


@pytest.fixture
def no_weights(monkeypatch):
    """Loading any weights fails the test: the check under test must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before the check")

    monkeypatch.setattr(cli, "_load_model", refuse)


def run(capsys, *argv):
    capsys.readouterr()  # drop what the test's own setup printed
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' weight-loading bar, if any
    assert code == 2, err
    assert err.startswith("longspec: error: "), err
    return err


def test_a_prompt_longer_than_the_models_positions(model_dir, tmp_path, capsys, no_weights):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text(" ".join(f"w{3 + i % 50}" for i in range(600)))
    err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(long_prompt),
              "--max-new-tokens", "8")
    assert "the prompt is 600 tokens and --max-new-tokens 8: prompt + max_new_tokens = 608 tokens exceeds the " \
           "model's max_position_embeddings (512)" in err


def test_an_unsupported_model_type(tmp_path, prompt_file, capsys, no_weights):
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=1,
                               eos_token_id=2)) \
        .save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path)
    err = run(capsys, "generate", "--target", str(tmp_path), "--prompt-file", str(prompt_file))
    assert f"--target {str(tmp_path)!r} is a gpt2 model; longspec decodes llama, mistral, qwen2, qwen3 models" in err


def test_chat_needs_a_chat_template(model_dir, prompt_file, capsys, no_weights):
    err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file), "--chat")
    assert "--chat: the target's tokenizer has no chat template" in err


def test_a_device_torch_does_not_know(model_dir, prompt_file, capsys, no_weights):
    err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file), "--device", "gpu0")
    assert "--device 'gpu0' is not a device" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one(model_dir, prompt_file, capsys, no_weights):
    err = run(capsys, "generate", "--target", str(model_dir), "--prompt-file", str(prompt_file), "--device", "cuda")
    assert "--device cuda: this machine has no CUDA device" in err


def test_a_cache_the_device_cannot_hold_is_refused_before_allocating(model_dir, prompt_file, capsys, monkeypatch):
    """With 1 MiB free, a 40-token prompt and 4096 new tokens (a cache of 4352 rows x 2 layers x K and V x 2 KV heads
    x 64 dims x 4 bytes = 8.5 MiB) are refused, and the decoder never runs."""
    monkeypatch.setattr(cli, "available_memory", lambda device: 1 << 20)
    allocated = []
    monkeypatch.setattr(longspec.SpeculativeDecoder, "generate", lambda *a, **k: allocated.append(1))
    target = tiny_target(TARGET_FAMILY)
    assert target.config.num_hidden_layers == 2 and target.config.num_key_value_heads == 2
    long_ctx = model_dir.parent / "long-ctx"
    if not long_ctx.exists():
        shutil.copytree(model_dir, long_ctx)
        cfg = json.loads((long_ctx / "config.json").read_text())
        cfg["max_position_embeddings"] = 8192
        (long_ctx / "config.json").write_text(json.dumps(cfg))
    err = run(capsys, "generate", "--target", str(long_ctx), "--prompt-file", str(prompt_file), "--dtype", "float32",
              "--drafter", "none", "--max-new-tokens", "4096")
    rows = -(-(40 + 4096 + 1) // 256) * 256
    need = 2 * 2 * rows * 2 * 64 * 4
    assert f"the KV cache ({rows} rows x 2 layers) needs {need / 2**20:.1f} MiB, more than the 1.0 MiB free on cpu" in err
    assert allocated == []
