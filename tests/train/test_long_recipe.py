"""The recipe's long-context mode (issue 18) on CPU: the RoPE base rule, window phases, contiguous draft data, the
held-out draft loss and steps-to-equal-loss, and the tiny long-context recipe end to end from a trained target."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from longspec.recipes.code_pair import SCALES, export_pair, main, run_recipe, scale_with
from longspec.recipes.long_context import (block_sample, draft_heldout_loss, draft_heldout_metrics, ntk_rope_theta,
                                           parse_windows, phase_steps, steps_to_equal_loss, window_tokens)
from longspec.recipes.pair_target import scratch_run
from longspec.train.corpus import iter_records


def test_ntk_rope_theta_keeps_the_slowest_pair_within_its_trained_angle():
    theta = ntk_rope_theta(1e6, 8192, 65536, 64)
    assert theta == pytest.approx(1e6 * 8 ** (64 / 62))
    # the slowest pair (i = d/2 - 1) turns at theta ** (-(d - 2) / d) per token
    slow = lambda base: base ** (-62 / 64)  # noqa: E731
    assert 65536 * slow(theta) == pytest.approx(8192 * slow(1e6))
    # the fastest pair (i = 0) is unchanged, pairs in between are slowed by less than the full factor 8
    mid = lambda base: base ** (-32 / 64)  # noqa: E731
    assert 1 < mid(1e6) / mid(theta) < 8
    assert ntk_rope_theta(5e5, 4096, 4096, 128) == 5e5
    for args, word in [((1e6, 8192, 4096, 64), "trained_len"), ((1e6, 8192, 65536, 63), "head_dim"),
                       ((float("nan"), 8192, 65536, 64), "theta")]:
        with pytest.raises(ValueError, match=word):
            ntk_rope_theta(*args)


def test_window_phases_parse_split_and_count():
    windows = parse_windows("32768x2:0.75, 65536x1:0.25")
    assert windows == ((32768, 2, 0.75), (65536, 1, 0.25))
    assert phase_steps(windows, 10) == [8, 2] and phase_steps(windows, 1) == [1, 0]
    assert window_tokens(windows, 10) == 8 * 65536 + 2 * 65536
    for spec in ["32768x2", "32768:1", "0x2:1", "512x1:0.5", "512x1:0.5,1024x0:0.5", "axb:1"]:
        with pytest.raises(ValueError, match="long_windows"):
            parse_windows(spec)


def test_scale_overrides_name_the_field_and_reject_bad_values():
    s = scale_with(SCALES["h200"], ["long_seconds=200", "short_seconds=none", "long_windows=32768x2:1",
                                    "draft_eval_contexts=16384,32768,65536"])
    assert (s.long_seconds, s.short_seconds, s.long_windows) == (200.0, None, ((32768, 2, 1.0),))
    assert s.draft_eval_contexts == (16384, 32768, 65536) and s.target_seq == 8192
    deep = scale_with(SCALES["h200-deep"], ["target_windows=2048x4:0.5,8192x1:0.5"])
    assert scratch_run(deep).windows == ((2048, 4, 0.5), (8192, 1, 0.5))
    assert scratch_run(scale_with(deep, ["target_windows=none"])).windows == ((8192, 8, 0.9), (65536, 1, 0.1))
    for bad, word in [("target_windows=2048x4:0.5", "target_windows: the shares"), ("nope=1", "scale field"),
                      ("long_steps", "FIELD=VALUE"), ("long_steps=many", "long_steps"),
                      ("long_windows=1:1", "long_windows"), ("name=x", "FIELD=VALUE")]:
        with pytest.raises(ValueError, match=word):
            scale_with(SCALES["h200"], [bad])


def test_block_sample_keeps_runs_of_consecutive_files(tmp_path):
    src = tmp_path / "all.jsonl"
    with open(src, "w") as f:
        for i in range(200):
            f.write(json.dumps({"package": f"p{i // 20}", "path": f"p{i // 20}/f{i}.py", "text": "x" * 100}) + "\n")
    n = block_sample(str(src), str(tmp_path / "s.jsonl"), want_chars=4000, block_chars=1000)
    kept = [int(r["path"].split("/f")[1][:-3]) for r in iter_records(str(tmp_path / "s.jsonl"))]
    assert n == len(kept) == 40  # 4 blocks of 10 files of 100 characters
    runs = [kept[i:i + 10] for i in range(0, 40, 10)]
    assert all(run == list(range(run[0], run[0] + 10)) for run in runs)  # contiguous ...
    assert [run[0] for run in runs] == [0, 50, 100, 150]  # ... and spread over the whole file
    assert block_sample(str(src), str(tmp_path / "a.jsonl"), 10**6, 1000) == 200


def test_steps_to_equal_loss():
    curves = {"anchor": [(10, 3.0), (20, 2.5), (30, 2.2)], "plain": [(10, 3.5), (20, 3.0), (30, 2.6)]}
    out = steps_to_equal_loss(curves)
    assert out["level"] == 2.6 and out["steps_to_level"] == {"anchor": 20, "plain": 30}
    assert out["steps_over_fastest"] == {"anchor": 1.0, "plain": 1.5}
    with pytest.raises(ValueError):
        steps_to_equal_loss({"a": []})


def test_draft_heldout_loss_is_plain_position_next_token_ce():
    """Against a direct computation: the target over the whole window at positions 0..L-1, the draft's logits
    through the target's LM head, cross-entropy on the next token at every position."""
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    from longspec import LongSpecDraft

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=512)).eval()
    draft = LongSpecDraft.from_target(target)
    with torch.no_grad():  # weights large enough that what the cross-attention reads shows in the loss
        for p in draft.parameters():
            p.normal_(0, 0.3)
    tokens = np.random.default_rng(0).integers(0, 64, 600).astype(np.uint16)
    got = draft_heldout_loss(draft, target, tokens, [40, 96], windows=2, device=torch.device("cpu"))
    assert set(got) == {40, 96}
    # the same windows as the function draws (seeded by the context), scored directly
    from longspec.recipes.long_context import random_windows
    from longspec.train.objective import run_target

    metrics = draft_heldout_metrics(draft, target, tokens, [40, 96], windows=2, device=torch.device("cpu"), chunk=32)
    for ctx in (40, 96):
        gen = torch.Generator().manual_seed(3 * 1_000_003 + ctx)
        total = kl = agree = count = 0
        for _ in range(2):
            ids = random_windows(tokens, ctx, 1, gen)
            pos = torch.arange(ctx)
            with torch.no_grad():
                t = run_target(target, ids, pos)
                hidden = draft(ids, t.k, t.v, position_ids=pos[None], delta=1)
                logits = hidden @ target.get_output_embeddings().weight.t()
                t_logits = target(ids).logits  # the target's own next-token distribution
            total += float(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum"))
            logq, logp = logits[0, :-1].double().log_softmax(-1), t_logits[0, :-1].double().log_softmax(-1)
            kl += float((logp.exp() * (logp - logq)).sum())
            agree += int((logq.argmax(-1) == logp.argmax(-1)).sum())
            count += ctx - 1
        assert got[ctx] == pytest.approx(total / count, rel=1e-5)
        assert metrics[ctx]["ce"] == pytest.approx(total / count, rel=1e-5)
        assert metrics[ctx]["kl"] == pytest.approx(kl / count, rel=1e-4) and metrics[ctx]["kl"] > 0
        assert metrics[ctx]["top1"] == agree / count and 0 < agree < count
    assert draft_heldout_loss(draft, target, tokens, [40], 2, torch.device("cpu")) == {40: got[40]}


def test_init_target_is_rebuilt_with_the_new_rope_base(base_pair):
    """The rotary frequencies the continuation trains with come from the new base (they are computed when the
    model is built, so setting the config of a built model would leave them at the old one)."""
    from longspec.recipes.code_pair import load_init_target

    model = load_init_target(str(base_pair / "target"), 4e6, 3000)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    want = 1.0 / 4e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.double(), want, rtol=1e-5, atol=0)
    assert model.config.max_position_embeddings == 3000 and model.config.rope_parameters["rope_theta"] == 4e6


def test_target_trainer_runs_the_window_phases_in_order(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    import longspec.recipes.code_pair as cp
    import longspec.recipes.pair_target as stage

    import numpy as np

    seen = []
    real = stage.random_windows
    monkeypatch.setattr(stage, "random_windows", lambda t, seq, batch, gen: seen.append((seq, batch)) or real(t, seq,
                                                                                                            batch, gen))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    run = cp.TargetRun(((8, 2, 0.25), (16, 1, 0.5), (32, 1, 0.25)), 1e-3, 0.1)
    trainer = cp._TargetTrainer(model, np.arange(200, dtype=np.uint16) % 32, run, 8, torch.device("cpu"))
    for _ in range(8):
        trainer.step()
    assert seen == [(8, 2)] * 2 + [(16, 1)] * 4 + [(32, 1)] * 2


@pytest.fixture(scope="module")
def base_pair(fake_site, tmp_path_factory):
    """A tiny target trained from scratch (the init target) and a draft for it (the init draft)."""
    from transformers import AutoModelForCausalLM

    from longspec import LongSpecDraft

    base = tmp_path_factory.mktemp("base")
    run_recipe(str(base), "tiny", roots=fake_site, device="cpu", stages=("data", "target"))
    target = AutoModelForCausalLM.from_pretrained(base / "target")
    draft = LongSpecDraft.from_target(target)
    with torch.no_grad():
        draft.input_layernorm.weight.fill_(0.5)  # recognisable: a fresh draft has 1.0 there
    draft.save_pretrained(base / "init_draft")
    return base


def test_tiny_long_context_recipe_continues_the_init_target(base_pair, fake_site, tmp_path):
    """--init-target: the tokenizer is the init target's, the continued target has the NTK base (in its rotary
    frequencies, not just its config) and raised positions, was trained over both window phases and evaluated
    before and after at every context; the drafts start from --init-draft on long windows with KL and anchor reach
    long_to_seq; stage short records curves, tau and steps to equal loss; the export ships and decodes exactly."""
    from transformers import AutoModelForCausalLM

    from longspec import LongSpecDraft, LongSpecDrafter, SpeculativeDecoder

    s = SCALES["tiny"]
    out = tmp_path / "long"
    init_t, init_d = str(base_pair / "target"), str(base_pair / "init_draft")
    rec = run_recipe(str(out), s, roots=fake_site, device="cpu", stages=("data", "target", "short"),
                     init_target=init_t)
    assert (out / "target" / "tokenizer.json").read_bytes() == (base_pair / "target" / "tokenizer.json").read_bytes()
    theta = ntk_rope_theta(s.rope_theta, s.long_from_seq, s.long_to_seq, s.hidden // s.heads)
    assert rec["target"]["rope_theta"]["to"] == pytest.approx(theta) and rec["init"]["target"]["rope_theta"] == 5e5
    assert rec["target"]["max_position_embeddings"] == 2 * s.long_to_seq
    assert rec["target"]["steps_per_window"] == [1, 2]  # round(0.5 * 3) = 2 of 1024 x 1 after 1 of 512 x 2
    assert rec["target"]["tokens_seen"] == 512 * 2 + 2 * 1024
    assert set(rec["target"]["heldout_loss_by_context"]) == set(rec["init"]["target"]["heldout_loss"]) == {"256",
                                                                                                          "1024"}
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    assert target.config.rope_parameters["rope_theta"] == pytest.approx(theta)
    head_dim = s.hidden // s.heads
    want = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(target.model.rotary_emb.inv_freq.double(), want, rtol=1e-5, atol=0)
    init_state = AutoModelForCausalLM.from_pretrained(init_t, dtype=torch.float32).state_dict()
    assert not torch.equal(target.state_dict()["lm_head.weight"], init_state["lm_head.weight"])  # it trained

    short = rec["short_ablation"]
    assert short["run"]["seq"] == s.short_seq and short["anchor_reach"] == s.long_to_seq
    assert short["eval_every"] == 2 and set(short["curves"]) == set(short["match"]) == {"short_anchor", "short_plain"}
    for name, curve in short["curves"].items():
        assert [step for step, _ in curve] == [2, 4] and set(curve[0][1]) == {"512", "1024"}
        assert all(math.isfinite(v) for _, losses in curve for v in losses.values())
        assert set(short["tau"][name]) == {"512", "1024"} and all(t >= 1 for t in short["tau"][name].values())
        assert sorted(p.name for p in (out / name).glob("checkpoint-*")) == ["checkpoint-4"]  # the rest scored
    assert set(short["summary"]) == {"512", "1024"}
    assert set(short["summary"]["1024"]["steps_to_level"]) == {"short_anchor", "short_plain"}
    train_cfg = json.loads((out / "short_anchor" / "train_config.json").read_text())
    assert train_cfg["max_positions"] == s.long_to_seq and train_cfg["anchor_offset"] and train_cfg["kl_weight"] == 0
    assert json.loads((out / "short_plain" / "train_config.json").read_text())["anchor_offset"] is False

    rec = run_recipe(str(out), s, roots=fake_site, device="cpu", stages=("drafts",), init_target=init_t,
                     init_draft=init_d, ablations=True)
    cfg = json.loads((out / "draft" / "train_config.json").read_text())
    assert (cfg["data"]["seq_len"], cfg["kl_weight"], cfg["max_positions"]) == (s.long_draft_seq, 1.0, s.long_to_seq)
    assert rec["draft"]["run"]["init"] == init_d and rec["init"]["draft"]["dir"].endswith("init_draft")
    assert set(rec["ablations"]["heldout_loss"]) == {"draft", "draft_no_anchor", "draft_no_noisy"}
    assert set(rec["draft"]["heldout_loss"]) == {"512", "1024"}
    assert json.loads((out / "draft_no_anchor" / "train_config.json").read_text())["anchor_offset"] is False
    for name in ("draft", "draft_no_anchor", "draft_no_noisy"):  # every variant started from the init draft
        trained = LongSpecDraft.from_pretrained(out / name, target=target)
        torch.testing.assert_close(trained.input_layernorm.weight, torch.full_like(trained.input_layernorm.weight,
                                                                                   0.5), atol=0.05, rtol=0)

    with pytest.raises(ValueError, match="another init target"):
        run_recipe(str(out), s, roots=fake_site, device="cpu", stages=("drafts",), init_target=str(out / "target"))
    with pytest.raises(ValueError, match="long-context recipe"):
        run_recipe(str(out), s, roots=fake_site, device="cpu", stages=("drafts",))
    with pytest.raises(ValueError, match="fields that differ: long_seconds"):
        run_recipe(str(out), scale_with(s, ["long_seconds=5"]), roots=fake_site, device="cpu", stages=("drafts",),
                   init_target=init_t)

    summary = export_pair(str(out), str(tmp_path / "ship"))
    assert summary["target"]["rope_theta"]["to"] == pytest.approx(theta) and summary["init"]["draft"]["sha256"]
    assert summary["bytes"] < 40e6
    with pytest.raises(ValueError, match="over the 0 MB"):
        export_pair(str(out), str(tmp_path / "ship2"), limit_bytes=1000)
    shipped = AutoModelForCausalLM.from_pretrained(tmp_path / "ship" / "target", dtype=torch.float32).eval()
    draft = LongSpecDraft.from_pretrained(tmp_path / "ship" / "draft", target=shipped)
    prompt = torch.randint(2, 300, (1, 1100))  # past the init target's 256-token windows
    plain = SpeculativeDecoder(shipped, None).generate(prompt, 12, eos_token_id=[])
    spec = SpeculativeDecoder(shipped, LongSpecDrafter(draft), tree_shape=(2, 2, 2)).generate(prompt, 12,
                                                                                                eos_token_id=[])
    assert torch.equal(plain.sequences, spec.sequences)


def test_a_target_trained_for_the_context_continues_at_its_own_rope_base(base_pair, fake_site, tmp_path):
    """long_from_seq == long_to_seq (the deep pair's target, trained to 64k from scratch, trained on): the RoPE
    base stays; a long_from_seq past long_to_seq is refused by name."""
    s = scale_with(SCALES["tiny"], ["long_from_seq=1024"])
    rec = run_recipe(str(tmp_path / "more"), s, roots=fake_site, device="cpu", stages=("data", "target"),
                     init_target=str(base_pair / "target"))
    assert rec["target"]["rope_theta"]["to"] == rec["init"]["target"]["rope_theta"] == 5e5
    assert rec["target"]["max_position_embeddings"] == 2 * s.long_to_seq
    with pytest.raises(ValueError, match="long_from_seq .2048. must be at most long_to_seq"):
        run_recipe(str(tmp_path / "bad"), scale_with(SCALES["tiny"], ["long_from_seq=2048"]), roots=fake_site,
                   device="cpu", stages=("target",), init_target=str(base_pair / "target"))


def test_recipe_command_rejects_bad_init_and_overrides(tmp_path, capsys):
    for argv, word in [(["--init-target", str(tmp_path / "none")], "--init-target"),
                       (["--init-target", str(tmp_path)], "--init-target"),  # a directory without a model
                       (["--init-draft", str(tmp_path)], "--init-draft needs --init-target"),
                       (["--set", "long_windows=1x1:0.5"], "long_windows"),
                       (["--target-steps", "0"], "--target-steps")]:
        with pytest.raises(SystemExit) as done:
            main(["--out", str(tmp_path / "o"), "--stages", "target", *argv])
        assert done.value.code == 2
        assert word in capsys.readouterr().err


def test_deep_scale_is_shaped_like_real_targets_and_fits_the_package():
    """Issue 33's scale: 16 layers or more against the one-block draft, RoPE for 128k positions, and target + draft in
    bf16 plus the shipped tokenizer's files under the package's limit (models built on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longspec import LongSpecDraft
    from longspec.pretrained import pair_path
    from longspec.recipes.pair_config import SHIP_LIMIT_BYTES

    s = SCALES["h200-deep"]
    assert s.layers >= 16 and s.max_positions >= 131072 and s.kv_heads < s.heads
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      max_position_embeddings=s.max_positions, rope_theta=s.rope_theta,
                      tie_word_embeddings=s.tie_embeddings)
    with torch.device("meta"):
        target = LlamaForCausalLM(cfg)
        draft = LongSpecDraft.from_target(target)
    weights = 2 * sum(p.numel() for m in (target, draft) for p in m.parameters())
    tokenizer = sum(f.stat().st_size for f in pair_path("target").glob("tokenizer*"))
    assert weights + tokenizer <= SHIP_LIMIT_BYTES


def test_long_steps_zero_adopts_the_init_target_and_continues_the_draft(base_pair, fake_site, tmp_path):
    """long_steps=0 (a draft continued against its final target, over several device calls): the recipe's target
    is the init target byte for byte (its tokenizer too), at its own RoPE base, without stage data's token file, and
    the draft starts from --init-draft, here under pure distillation (long_draft_ce_weight=0) and widened
    (long_draft_intermediate) and grown by a cross block (long_draft_add_cross_blocks)."""
    from safetensors.torch import load_file

    from longspec import LongSpecDraft

    s = scale_with(SCALES["tiny"], ["long_steps=0", "long_draft_ce_weight=0", "long_draft_intermediate=192",
                                    "long_draft_add_cross_blocks=1"])
    out = tmp_path / "adopt"
    rec = run_recipe(str(out), s, roots=fake_site, device="cpu", stages=("target", "drafts"),
                     init_target=str(base_pair / "target"), init_draft=str(base_pair / "init_draft"))
    assert not (out / "corpus" / "train.u16").exists()  # nothing trains on the target's token file
    init, got = load_file(base_pair / "target" / "model.safetensors"), load_file(out / "target" / "model.safetensors")
    assert init.keys() == got.keys() and all(torch.equal(init[k], got[k]) for k in init)
    t = rec["target"]
    assert t["adopted"] and t["steps"] == 0 and t["rope_theta"]["to"] == rec["init"]["target"]["rope_theta"]
    assert set(t["heldout_loss_by_context"]) == set(rec["init"]["target"]["heldout_loss"]) == {"256", "1024"}
    assert rec["draft"]["run"]["init"] == str(base_pair / "init_draft") and rec["draft"]["steps"] == s.draft_steps
    assert (rec["draft"]["run"]["ce_weight"], rec["draft"]["run"]["kl_weight"]) == (0.0, 1.0)
    assert rec["draft"]["run"]["intermediate"] == 192 and rec["draft"]["run"]["add_cross_blocks"] == 1
    cfg = json.loads((out / "draft" / "train_config.json").read_text())
    assert (cfg["ce_weight"], cfg["kl_weight"]) == (0.0, 1.0)
    summary = export_pair(str(out), str(tmp_path / "ship"))
    assert summary["target"]["steps"] == 0 and summary["init"]["draft"]["sha256"]
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tmp_path / "ship" / "target", dtype=torch.float32)
    trained = LongSpecDraft.from_pretrained(tmp_path / "ship" / "draft", target=target)
    norm = trained.input_layernorm.weight.float()
    torch.testing.assert_close(norm, torch.full_like(norm, 0.5), atol=0.05, rtol=0)  # from the init draft
    assert trained.config.intermediate_size == 192 and trained.mlp.down_proj.weight.shape[1] == 192
    assert trained.config.extra_cross_blocks == 1 and trained.extra_blocks[0].mlp.down_proj.weight.any()
