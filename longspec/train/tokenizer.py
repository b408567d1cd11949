"""A byte-level BPE tokenizer trained on the code corpus with the ``tokenizers`` library, saved as a transformers
``PreTrainedTokenizerFast`` directory (``AutoTokenizer.from_pretrained(out_dir)`` loads it).

Byte-level (GPT-2 style): every string round-trips exactly, whatever its characters, which lossless decoding
comparisons and code (indentation, odd unicode) both need. Special tokens: ``<|endoftext|>`` (id 0, EOS: it
separates packed documents) and ``<|pad|>`` (id 1).
"""
from __future__ import annotations

import json
import os
from typing import Iterator, Sequence

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def iter_texts(jsonl_paths: Sequence[str], field: str = "text", max_chars: int | None = None) -> Iterator[str]:
    """The ``field`` of every record, in file order, stopping once ``max_chars`` characters were given."""
    total = 0
    for path in jsonl_paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                text = json.loads(line)[field]
                yield text
                total += len(text)
                if max_chars is not None and total >= max_chars:
                    return


def train_bpe_tokenizer(jsonl_paths: Sequence[str], vocab_size: int, out_dir: str, max_chars: int | None = None,
                        min_frequency: int = 2, field: str = "text"):
    """Train a byte-level BPE of ``vocab_size`` tokens (specials and the 256 byte tokens included) on the records
    of ``jsonl_paths`` (the first ``max_chars`` characters when given), save it to ``out_dir`` and return it as a
    ``PreTrainedTokenizerFast``. Deterministic for the same input text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258 + 2:
        raise ValueError(f"vocab_size must leave room for 256 bytes and 2 specials, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(iter_texts(jsonl_paths, field, max_chars), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 20)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258 (2 is EOS): a real, deterministic tokenizer with no training, for experiments
    (``longspec.recipes.draft_objective``) and throughput benchmarks."""

    eos_token_id = 2

    def __len__(self) -> int:
        return 259

    def __call__(self, text, add_special_tokens=False):  # a string or a batch of strings, as in transformers
        def encode(t: str) -> list[int]:
            return [b + 3 for b in t.encode("utf-8")]

        return {"input_ids": encode(text) if isinstance(text, str) else [encode(t) for t in text]}
