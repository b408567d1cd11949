"""Fixtures of the command-line tests: a tiny Llama target with a word-level tokenizer saved as a model directory."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .tiny_targets import VOCAB, tiny_target

TARGET_FAMILY = "llama-gqa-d64"


def save_word_tokenizer(path) -> None:
    """Ids 0..VOCAB-1 for the words <unk> <s> </s> w3 w4 ... (id 2 = </s> = the tiny targets' EOS)."""
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>") \
        .save_pretrained(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_word_tokenizer(path)
    tiny_target(TARGET_FAMILY).save_pretrained(path)
    return path


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text(" ".join(f"w{3 + (i * 7) % 11}" for i in range(40)))
    return f
