"""tau of the shipped pair's LongSpec tree with the full vocabulary and with reduced drafting vocabularies.

The reduced vocabularies are the most frequent tokens of the pair's training split as this machine rebuilds it
(the local standard library's training packages, split by package name as the recipe does; the pair itself was
trained on an H200 machine's Python source, so the counts approximate its training data). tau (tokens per target
forward, greedy) does not depend on the hardware in float32, so this runs on a CPU:

    python -m benchmarks.draft_vocab_tau --context 2048 --prompts 3 --sizes 0 4096 2048 1024 --out DIR

It writes ``draft_vocab_tau.{json,md}`` (and, with ``--write-vocab N``, the pair's ``draft/draft_vocab.json`` of the N
most frequent tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile

import torch

from benchmarks.harness import write_results
from longspec import LongSpecDrafter, SpeculativeDecoder
from longspec.model.draft import count_tokens, frequent_tokens, save_draft_vocab
from longspec.pretrained import PAIR_DIR, load_code_pair
from longspec.train.corpus import build_corpus, heldout_prompts, iter_records

TREE = (4, 16, 16, 16, 16)


def training_counts(tokenizer, vocab: int, max_chars: int, heldout_frac: float) -> tuple[torch.Tensor, str, dict]:
    """Token counts over (up to ``max_chars`` of) the training split, and the held-out jsonl of the same split."""
    tmp = tempfile.mkdtemp(prefix="longspec-vocab-")
    stats = build_corpus(tmp, roots=[sysconfig.get_paths()["stdlib"]], heldout_frac=heldout_frac,
                         max_chars=max_chars)
    texts = [r["text"] for r in iter_records(stats.train_jsonl)]
    batches = (tokenizer(texts[i:i + 256], add_special_tokens=False)["input_ids"] for i in range(0, len(texts), 256))
    counts = count_tokens((torch.tensor(ids) for batch in batches for ids in batch if ids), vocab)
    return counts, stats.heldout_jsonl, {"train_chars": stats.chars["train"], "train_packages": stats.packages["train"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 4096, 2048, 1024], help="0: the full vocabulary")
    ap.add_argument("--max-chars", type=int, default=40_000_000, help="training text counted")
    ap.add_argument("--write-vocab", type=int, default=0, help="write the pair's draft_vocab.json of this size")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="default: benchmarks/results/cpu/")
    a = ap.parse_args(argv)
    pair = load_code_pair("cpu", torch.float32)
    vocab = pair.target.get_output_embeddings().weight.shape[0]
    counts, heldout, corpus = training_counts(pair.tokenizer, vocab, a.max_chars, pair.info["heldout_frac"])
    prompts, packages = heldout_prompts(heldout, pair.tokenizer, a.context, a.prompts, seed=a.context)
    rows, reference = [], None
    for size in a.sizes:
        pair.draft.set_draft_vocab(frequent_tokens(counts, size) if size else None)
        dec = SpeculativeDecoder(pair.target, LongSpecDrafter(pair.draft), tree_shape=TREE)
        emitted = forwards = 0
        outputs = []
        for ids in prompts:
            out = dec.generate(ids, a.new_tokens, eos_token_id=[])
            emitted += sum(sum(x) for x in out.accept_lengths)
            forwards += sum(len(x) for x in out.accept_lengths)
            outputs.append(out.sequences)
        reference = reference if reference is not None else outputs
        same = all(torch.equal(x, y) for x, y in zip(outputs, reference))
        coverage = float(counts[frequent_tokens(counts, size)].sum() / counts.sum()) if size else 1.0
        rows.append({"draft_vocab": size or vocab, "tau": emitted / forwards, "train_token_coverage": coverage,
                     "same_output_as_full": same})
        print(json.dumps(rows[-1]), flush=True)
    pair.draft.set_draft_vocab(None)
    if a.write_vocab:
        save_draft_vocab(PAIR_DIR / "draft", frequent_tokens(counts, a.write_vocab))
    meta = {"context": a.context, "prompts": a.prompts, "packages": packages, "new_tokens": a.new_tokens,
            "tree": "-".join(map(str, TREE)), "dtype": "float32", **corpus}
    write_results("draft_vocab_tau", rows, a.out, meta=meta, title="tau with a reduced drafting vocabulary",
                  notes=["The shipped pair, LongSpec tree, greedy, float32 on a CPU. `python -m "
                         "benchmarks.draft_vocab_tau`"],
                  columns=[("draft_vocab", "draft vocabulary", ""), ("tau", "tau", ".2f"),
                           ("train_token_coverage", "training tokens covered", ".3f"),
                           ("same_output_as_full", "same output", "")])


if __name__ == "__main__":
    main()
