"""The code-pair recipe on CPU: corpus split, BPE tokenizer, held-out prompts, and the tiny recipe end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longspec.decode.budget import CostModel
from longspec.pretrained import PAIR_DIR
from longspec.train.corpus import build_corpus, heldout_prompts, is_heldout, iter_records
from longspec.train.tokenizer import EOS_TOKEN, train_bpe_tokenizer
from tests.train.conftest import PACKAGES


@pytest.fixture(scope="module")
def corpus(fake_site, tmp_path_factory):
    return build_corpus(str(tmp_path_factory.mktemp("corpus")), roots=fake_site, heldout_frac=0.3)


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    from transformers import AutoTokenizer

    out = str(tmp_path_factory.mktemp("tok"))
    train_bpe_tokenizer([corpus.train_jsonl], 400, out)
    return AutoTokenizer.from_pretrained(out)


def _packages(jsonl):
    return [r["package"] for r in iter_records(jsonl)]


def test_corpus_split_is_by_package_disjoint_and_deterministic(fake_site, corpus, tmp_path):
    train, held = set(_packages(corpus.train_jsonl)), set(_packages(corpus.heldout_jsonl))
    assert train and held and not train & held
    assert train | held == set(PACKAGES)
    assert all(is_heldout(p, 0.3) for p in held) and not any(is_heldout(p, 0.3) for p in train)
    again = build_corpus(str(tmp_path), roots=fake_site, heldout_frac=0.3)
    for a, b in [(corpus.train_jsonl, again.train_jsonl), (corpus.heldout_jsonl, again.heldout_jsonl)]:
        assert open(a, "rb").read() == open(b, "rb").read()


def test_corpus_records_skip_caches_metadata_big_and_non_utf8(corpus):
    paths = [r["path"] for j in (corpus.train_jsonl, corpus.heldout_jsonl) for r in iter_records(j)]
    assert "pkg0/sub/deep.py" in paths and "pkg2.py" in paths
    assert not any("__pycache__" in p or "dist-info" in p or "__editable__" in p or p.endswith(("latin1.py", "big.py"))
                   for p in paths)
    assert all(p.split("/")[0].removesuffix(".py") == r for p, r in
               zip(paths, _packages(corpus.train_jsonl) + _packages(corpus.heldout_jsonl)))
    assert corpus.skipped_files == 2


def test_tokenizer_round_trips_and_has_eos(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 1
    assert 258 < len(tokenizer) <= 400  # the tiny corpus may run out of pairs seen twice before 400
    for text in ["def f(x):\n\treturn x  # ok\n", "  s = 'é ☃ 日本'\r\n", ""]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # merges were learned: code compresses below one token per byte
    sample = "def core_1(x, y=1):\n    total = x * 1 + y\n"
    assert len(tokenizer(sample)["input_ids"]) < len(sample.encode()) / 2


def test_heldout_prompts_continue_a_file_of_one_package(corpus, tokenizer):
    budget, prefix = 600, 40
    prompts, names = heldout_prompts(corpus.heldout_jsonl, tokenizer, budget, n=3, seed=1, prefix_tokens=prefix)
    assert len(prompts) == 3 and len(names) == 3
    files = {(r["package"], r["path"]): r["text"] for r in iter_records(corpus.heldout_jsonl)}
    for ids, package in zip(prompts, names):
        assert ids.shape == (1, budget) and ids.dtype == torch.long
        text = tokenizer.decode(ids[0])
        headers = [line[len("# file: "):] for line in text.splitlines() if line.startswith("# file: ")]
        assert headers and all(h.split("/")[0].removesuffix(".py") == package for h in headers)
        last = headers[-1]
        tail = text[text.rindex("\n# file: " + last + "\n") + len("\n# file: " + last + "\n"):]
        assert last not in headers[:-1] and len(headers) >= 2  # context comes from other files of the package
        full = files[(package, last)]
        assert full.startswith(tail) and len(tail) < len(full)  # ends inside the file, more of it follows
    again, _ = heldout_prompts(corpus.heldout_jsonl, tokenizer, budget, n=3, seed=1, prefix_tokens=prefix)
    assert all(torch.equal(a, b) for a, b in zip(prompts, again))
    with pytest.raises(ValueError):
        heldout_prompts(corpus.heldout_jsonl, tokenizer, 10**6, n=1)


@pytest.mark.parametrize("kind", ["packages", "skeleton"])
def test_pooled_heldout_prompts_mix_packages(corpus, tokenizer, kind):
    """Pooled prompts draw their context from several held-out packages in turn; skeleton prompts show only the
    outlines (signatures and docstrings) of their context files, the continued file's own last, so what follows the
    prompt is code it does not contain."""
    budget, prefix = 3000, 40
    prompts, names = heldout_prompts(corpus.heldout_jsonl, tokenizer, budget, n=2, seed=3, prefix_tokens=prefix,
                                     kind=kind)
    files = {r["path"]: r["text"] for r in iter_records(corpus.heldout_jsonl)}
    for ids, name in zip(prompts, names):
        assert ids.shape == (1, budget)
        text = tokenizer.decode(ids[0])
        headers = [line[len("# file: "):] for line in text.splitlines() if line.startswith("# file: ")]
        packages = {h.split("/")[0].removesuffix(".py") for h in headers}
        assert len(packages) >= 2 and set(name.split("+")) == packages
        last = headers[-1]
        cut = text.rindex("\n# file: " + last + "\n")
        tail, context = text[cut + len("\n# file: " + last + "\n"):], text[:cut]
        assert files[last].startswith(tail) and len(tail) < len(files[last])
        if kind == "skeleton":
            assert "total = x" not in context and "def " in context  # bodies gone, signatures kept
            assert headers[-2] == last  # the continued file's outline stands just before it
        else:
            assert last not in headers[:-1] and "total = x" in context
    again, _ = heldout_prompts(corpus.heldout_jsonl, tokenizer, budget, n=2, seed=3, prefix_tokens=prefix, kind=kind)
    assert all(torch.equal(a, b) for a, b in zip(prompts, again))
    with pytest.raises(ValueError, match="kind must be one of"):
        heldout_prompts(corpus.heldout_jsonl, tokenizer, budget, n=1, kind="copy")


def test_tiny_recipe_in_stages_with_budgets_decodes_exactly(fake_site, tmp_path):
    """data + target in one process; drafts in another over the same directory after the corpus was lost (a fresh
    machine): the corpus is rebuilt identically, the tokenizer is kept; step counts come from the timed probes."""
    import dataclasses
    import shutil

    from transformers import AutoTokenizer, LlamaForCausalLM

    from longspec.recipes.code_pair import SCALES, export_pair, run_recipe
    from longspec import LongSpecDraft, LongSpecDrafter, SpeculativeDecoder

    scale = dataclasses.replace(SCALES["tiny"], target_seconds=60.0, target_steps=3, draft_seconds=60.0,
                                draft_steps=2, draft_kl_weight=0.5)
    out = tmp_path / "pair"
    first = run_recipe(str(out), scale, roots=fake_site, device="cpu", stages=("data", "target"))
    assert "draft" not in first and first["target"]["steps"] == 3 and first["target"]["probe_step_s"] > 0
    # round(0.5 * 3) = 2 long-window steps of 512 x 1, after one step of 256 x 2
    assert first["target"]["tokens_seen"] == 256 * 2 + 2 * 512 * 1
    assert first["target"]["heldout_loss_long"] > 0
    assert set(first["target"]["heldout_loss_by_context"]) == {str(c) for c in scale.eval_contexts}
    assert set(first["wall_s"]) == {"corpus", "tokenizer", "pretokenize", "target"}
    tokenizer_json = (out / "target" / "tokenizer.json").read_bytes()
    shutil.rmtree(out / "corpus")
    record = run_recipe(str(out), scale, roots=fake_site, device="cpu", stages=("drafts",))
    assert (out / "target" / "tokenizer.json").read_bytes() == tokenizer_json
    assert record["target"] == first["target"] and record["draft"]["steps"] == 2
    assert record["draft"]["probe_step_s"] > 0 and len(record["draft"]["loss"]["curve"]) == 2
    saved = json.loads((out / "recipe.json").read_text())
    assert saved["draft"]["loss"] == record["draft"]["loss"] and "draft" in saved["wall_s"]
    assert record["draft"]["run"]["kl_weight"] == 0.5
    # every checkpoint scored on held-out windows (the curve), the last one's loss the draft's, beside the target's
    curve = record["draft_heldout_curves"]["draft"]
    assert [step for step, _ in curve] == [1, 2] and curve[-1][1] == record["draft"]["heldout_loss"]
    match = record["draft_heldout_match"]["draft"]  # the same pass: KL to the target and top-1 agreement
    assert [step for step, _ in match] == [1, 2] and set(match[-1][1]) == set(curve[-1][1])
    assert all(m["kl"] >= 0 and 0 <= m["top1"] <= 1 for _, by_ctx in match for m in by_ctx.values())
    assert set(record["draft_heldout_loss"]["target"]) == set(curve[-1][1]) == {str(c) for c in
                                                                                scale.draft_eval_contexts}
    assert sorted(p.name for p in (out / "draft").glob("checkpoint-*")) == ["checkpoint-2"]
    with pytest.raises(ValueError, match="another scale"):
        run_recipe(str(out), "tiny", roots=fake_site, device="cpu", stages=("drafts",))
    # a record from before draft_kl_weight existed (no such field) resumes under a scale holding its default, 0
    old = {**saved, "scale": {k: v for k, v in saved["scale"].items() if k != "draft_kl_weight"}}
    (out / "recipe.json").write_text(json.dumps(old))
    resumed = run_recipe(str(out), dataclasses.replace(scale, draft_kl_weight=0.0), roots=fake_site, device="cpu",
                         stages=("drafts",))
    assert resumed["draft"]["steps"] == 2 and resumed["scale"]["draft_kl_weight"] == 0.0
    (out / "recipe.json").write_text(json.dumps(record))

    summary = export_pair(str(out), str(tmp_path / "shipped"))
    assert summary["draft"]["steps"] == 2 and summary["draft"]["heldout_loss"] == record["draft"]["heldout_loss"]
    target_dir = tmp_path / "shipped" / "target"
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assert target.config.rope_parameters["rope_theta"] >= 500000 and target.config.tie_word_embeddings
    draft = LongSpecDraft.from_pretrained(tmp_path / "shipped" / "draft", target=target)
    prompt = tok("def core_3(x, y=3):\n    total = x *", return_tensors="pt")["input_ids"]
    plain = SpeculativeDecoder(target, None).generate(prompt, 24, eos_token_id=[])
    spec = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(2, 2, 2)).generate(
        prompt, 24, eos_token_id=[])
    assert torch.equal(plain.sequences, spec.sequences)
    assert plain.sequences.shape == (1, prompt.shape[1] + 24)


def test_e2e_benchmark_on_the_tiny_pair(tmp_path, fake_site):
    """The end-to-end benchmark (run as its command, as on a GPU) runs every method on the tiny recipe's pair (with
    ablation drafts) and, at T = 0 and T = 1 (seed-exact), every engine method reproduces Vanilla FA's tokens; the
    drafters' per-depth acceptance adds up to their tau; the float32 check marks the rows it ran; contexts past the
    target's positions are refused before anything loads."""
    from longspec.recipes.code_pair import run_recipe

    record = run_recipe(str(tmp_path), "tiny", roots=fake_site, device="cpu", ablations=True)
    assert set(record["ablations"]["steps_to_level"]) == {"draft", "draft_no_anchor", "draft_no_noisy"}
    refused = subprocess.run([sys.executable, "-m", "benchmarks.bench_e2e", "--pair", str(tmp_path), "--contexts",
                              "160", "4090", "--device", "cpu"], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).parents[2])
    assert refused.returncode == 2 and "--contexts 4090" in refused.stderr  # 4090 + 256 new tokens > 4096
    shipped = subprocess.run([sys.executable, "-m", "benchmarks.bench_e2e", "--pair", str(PAIR_DIR), "--device",
                              "cpu"], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert shipped.returncode == 2 and "--heldout" in shipped.stderr  # an exported pair needs the held-out split
    cmd = [sys.executable, "-m", "benchmarks.bench_e2e", "--pair", str(tmp_path), "--contexts", "160",
           "--prompts", "1", "--new-tokens", "6", "--temperatures", "0", "1", "--device", "cpu",
           "--fp32-check", "160", "--fp32-new-tokens", "4", "--trees", "2-2", "--out", str(tmp_path / "results")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2],
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "results" / "e2e.json").read_text())["rows"]
    methods = {r["method"] for r in rows}
    assert {"Vanilla HF", "Vanilla FA", "LongSpec tree", "LongSpec (no_anchor) tree", "PLD chain 6",
            "adaptive LongSpec+PLD", "LongSpec tree 2-2"} <= methods
    assert len(rows) == 2 * len(methods)
    for r in rows:
        if r["method"] != "Vanilla HF":
            assert r["identical_to_FA"] and r["identical_fp32"] is True, r
            assert sum(r["accept_hist"]) >= 1
            assert r["tau"] == pytest.approx(sum((i + 1) * c for i, c in enumerate(r["accept_hist"]))
                                             / sum(r["accept_hist"]))
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and r["peak_bytes"] is None  # no GPU: not measured
    adaptive = [r for r in rows if r["method"] == "adaptive LongSpec+PLD"]
    assert all(r["calibrate_s"] > 0 and r["nodes_per_round"] >= 1 for r in adaptive)
    for r in adaptive:  # rounds per chosen option, and the cost model they were chosen by
        assert sum(r["options"].values()) == sum(r["accept_hist"]) and CostModel.from_json(r["costs"]).verify
    longspec = next(r for r in rows if r["method"] == "LongSpec tree")
    assert longspec["draft_bytes"] > 0 and longspec["tree_scratch_bytes"] > 0
    assert len(longspec["accept_by_depth"]) == 5 and longspec["tau"] == pytest.approx(
        1 + sum(longspec["accept_by_depth"]))
    # the real-size projection: measured tau x measured plain step / measured round
    steps = {"meta": {}, "rows": [{"model": "M", "context": 160, "compile": True, "decode_wall_us": 1000.0,
                                   "round_wall_us": 2000.0}]}
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    proj = subprocess.run([sys.executable, "-m", "benchmarks.project_speedup", "--e2e",
                           str(tmp_path / "results" / "e2e.json"), "--steps", str(tmp_path / "steps.json"),
                           "--context", "160", "--out", str(tmp_path / "proj")], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert proj.returncode == 0, proj.stderr[-2000:]
    projected = json.loads((tmp_path / "proj" / "projection.json").read_text())["rows"]
    assert [r["T"] for r in projected] == [0.0, 1.0]
    for r in projected:
        assert r["speedup"] == pytest.approx(r["tau"] / 2) and r["tau"] == pytest.approx(
            next(x["tau"] for x in rows if x["method"] == "LongSpec tree" and x["T"] == r["T"]))
    fp32 = json.loads((tmp_path / "results" / "e2e_fp32.json").read_text())["rows"]
    assert {r["method"] for r in fp32} == methods - {"Vanilla HF"}
    table = [line for line in (tmp_path / "results" / "e2e.md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == len(rows) + 1  # the header, then one line per row
