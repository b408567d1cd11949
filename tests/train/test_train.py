"""Draft training on CPU: data, anchor-offset positions, flash-noisy visibility, the loop, resume, distributed."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from longspec.model.draft import (LongSpecDraft, frequent_tokens, load_draft_vocab, shifted_cross_attention,
                                  windowed_self_attention)
from longspec.train.data import DataConfig, PackedStream
from longspec.train.loss import chunked_lm_loss
from longspec.train.positions import anchor_offset_positions
from longspec.train.trainer import Parallel, TrainConfig, train

VOCAB = 64


class CharTokenizer:
    """Characters to ids 2..63 (1 is EOS): a real, deterministic tokenizer small enough for a CPU test."""

    eos_token_id = 1

    def __len__(self) -> int:
        return VOCAB

    def __call__(self, text, add_special_tokens=False):  # a string or a batch of strings, as in transformers
        encode = lambda t: [2 + (ord(c) % (VOCAB - 2)) for c in t]  # noqa: E731
        return {"input_ids": encode(text) if isinstance(text, str) else [encode(t) for t in text]}


def tiny_target(max_pos: int = 4096, seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos)
    return LlamaForCausalLM(cfg)


def write_corpus(path, n=300, field="text"):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({field: f"def f{i % 7}(x):\n    return x * {i % 5} + {i % 3}\n"}) + "\n")
    return str(path)


def config(tmp_path, **over):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = DataConfig(paths=[write_corpus(tmp_path / "corpus.jsonl")], seq_len=96)
    base = dict(data=data, out_dir=str(tmp_path / "out"), steps=6, batch_size=2, lr=3e-3, save_every=3,
                log_every=1, progress=False, seed=1)
    base.update(over)
    return TrainConfig(**base)


# --- data -------------------------------------------------------------------------------------------------------


def test_packing_streams_every_format(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 40)
    write_corpus(tmp_path / "b.jsonl", n=5, field="body")
    cfg = DataConfig(paths=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], field="body", seq_len=32)
    tok = CharTokenizer()
    seqs = []
    it = PackedStream(cfg, tok).iter_from(0)
    for _ in range(20):
        seqs.append(next(it))
    flat = torch.cat(seqs).tolist()
    want = tok("hello world\n" * 40)["input_ids"] + [1]
    assert flat[: len(want)] == want  # documents are concatenated with EOS in order
    assert all(s.shape == (32,) for s in seqs)


class RecordingTokenizer(CharTokenizer):
    """CharTokenizer that keeps every text it was asked to encode."""

    def __init__(self):
        self.seen: list[str] = []

    def __call__(self, text, add_special_tokens=False):
        self.seen.extend([text] if isinstance(text, str) else text)
        return super().__call__(text, add_special_tokens)


def test_ranks_read_and_tokenise_disjoint_shares_that_cover_the_data(tmp_path):
    """Sharding by rank (issue 23): the files' byte space is cut into K contiguous ranges and rank r reads and
    tokenises only the documents that start in its range: the ranks' shares, in rank order, are the one-rank stream
    (every jsonl record and parquet row once, the text in order), and each rank's tokenizer sees only its share."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from longspec.train.data import iter_documents, shard_ranges

    (tmp_path / "a.txt").write_text("".join(f"line {i} of a plain-text document\n" for i in range(120)))
    write_corpus(tmp_path / "b.jsonl", n=40)
    pq.write_table(pa.table({"text": [f"row {i}" * (i % 4 + 1) for i in range(60)]}), tmp_path / "c.parquet",
                   row_group_size=7)
    paths = [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.parquet")]
    cfg = DataConfig(paths=paths, seq_len=16)
    one = list(iter_documents(cfg))
    records = [t for t, _ in one[1:]]  # after the text file (one piece: it is shorter than a chunk)
    for K in (2, 3, 5):
        shares = [list(iter_documents(cfg, r, K)) for r in range(K)]
        assert all(shares), "every rank gets documents"
        assert "".join(t for share in shares for t, _ in share) == "".join(t for t, _ in one)
        text_pieces = [p for share in shares for p in share if p[0].startswith("line ")]
        assert all(ends for _, ends in text_pieces)  # a rank's piece of the text file ends its document
        assert [t for share in shares for t, _ in share if not t.startswith("line ")] == records
        ranges = [shard_ranges(paths, r, K) for r in range(K)]
        for i, path in enumerate(paths):  # per file, the ranks' byte ranges tile it
            parts = [rs[i] for rs in ranges if rs[i] is not None]
            assert parts[0].start == 0 and parts[-1].end == os.path.getsize(path)
            assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
    toks = [RecordingTokenizer() for _ in range(2)]
    streams = [PackedStream(cfg, tok, rank=r, world_size=2).iter_from(0) for r, tok in enumerate(toks)]
    firsts = [next(s) for s in streams]
    for r, tok in enumerate(toks):  # the share is far below one tokenizer batch: the first call encoded all of it
        assert tok.seen == [t for t, _ in iter_documents(cfg, r, 2)]
    assert not set(toks[0].seen) & set(toks[1].seen)
    # resuming skips exactly within the rank's own stream
    later = PackedStream(cfg, CharTokenizer(), rank=1, world_size=2).iter_from(1)
    assert torch.equal(next(later), next(streams[1])) and not torch.equal(firsts[0], firsts[1])
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size=2\), got 2"):
        PackedStream(cfg, CharTokenizer(), rank=2, world_size=2)
    tiny = tmp_path / "tiny.jsonl"
    write_corpus(tiny, n=1)
    with pytest.raises(ValueError, match=r"rank 1's share \(of 2\) of the training data .* fewer documents than"):
        next(PackedStream(DataConfig(paths=[str(tiny)], seq_len=16), CharTokenizer(), rank=1, world_size=2)
             .iter_from(0))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["abc" * 20, "xyz" * 20]}), tmp_path / "d.parquet")
    it = PackedStream(DataConfig(paths=[str(tmp_path / "d.parquet")], field="content", seq_len=16),
                      CharTokenizer()).iter_from(0)
    assert next(it).tolist() == CharTokenizer()("abc" * 6)["input_ids"][:16]


def test_missing_field_and_missing_file(tmp_path):
    write_corpus(tmp_path / "c.jsonl", n=3)
    with pytest.raises(KeyError, match=r"c.jsonl:1: record has no field 'code'"):
        next(PackedStream(DataConfig(paths=[str(tmp_path / "c.jsonl")], field="code"), CharTokenizer()).iter_from(0))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        PackedStream(DataConfig(paths=[str(tmp_path / "none*.jsonl")]), CharTokenizer())


# --- anchor-offset positions and flash-noisy visibility ----------------------------------------------------------


def test_anchor_offset_positions():
    g = torch.Generator().manual_seed(0)
    sinks, offsets = set(), []
    for _ in range(200):
        pos = anchor_offset_positions(100, 4096, g)
        jumps = (pos.diff() != 1).nonzero().flatten()
        assert len(jumps) <= 1 and pos.max() < 4096 and pos.min() == 0 or pos[0] > 0
        sink = int(jumps[0]) + 1 if len(jumps) else (0 if pos[0] > 0 else 100)
        if sink < 100:
            assert pos[:sink].tolist() == list(range(sink))
            assert (pos[sink:].diff() == 1).all()
        sinks.add(sink if pos[0] == 0 else 0)
        offsets.append(int(pos[-1]) - 99)
    assert sinks <= {0, 1, 2, 3, 4, 100} and {0, 1, 2, 3, 4} <= sinks | {100}
    assert max(offsets) > 3000  # offsets span the target's range
    assert anchor_offset_positions(100, 4096, g, enabled=False).tolist() == list(range(100))
    with pytest.raises(ValueError, match=r"seq_len \(5000\) exceeds the target's max_position_embeddings \(4096\)"):
        anchor_offset_positions(5000, 4096, g)


def _dense(q, k, v, visible):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / q.shape[-1] ** 0.5
    s = s.masked_fill(~visible[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v.double())


@pytest.mark.parametrize("delta", [1, 2, 5])
def test_flash_noisy_shift_equals_dense_mask(delta):
    g = torch.Generator().manual_seed(delta)
    B, S, Hq, Hkv, D = 2, 23, 4, 2, 8
    q = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64)
    k, v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64), torch.randn(B, S, Hkv, D, generator=g,
                                                                                     dtype=torch.float64)
    t = torch.arange(S)
    visible = (t[None, :] <= t[:, None] - delta)[None].expand(B, S, S)  # query t sees rows <= t - delta
    torch.testing.assert_close(shifted_cross_attention(q, k, v, delta), _dense(q, k, v, visible))


def test_windowed_self_attention_equals_dense_mask_with_anchor_offset():
    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D, W = 2, 37, 4, 2, 8, 6
    q = torch.randn(B, S, Hq, D, generator=g, dtype=torch.float64)
    k, v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64), torch.randn(B, S, Hkv, D, generator=g,
                                                                                     dtype=torch.float64)
    pos = torch.arange(S).clone()
    pos[3:] += 1000  # 3 anchors, then an offset: anchors fall out of the window
    pos = pos.expand(B, S)
    i = torch.arange(S)
    visible = (i[None, :] <= i[:, None]) & (pos[0][:, None] - pos[0][None, :] <= W)
    torch.testing.assert_close(windowed_self_attention(q, k, v, pos, W), _dense(q, k, v, visible[None].expand(B, S, S)))


def test_chunked_loss_matches_full_cross_entropy():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[3] = -100
    loss, n = chunked_lm_loss(h, w, labels, chunk=8)
    loss.backward()
    grad = h.grad.clone()
    h.grad = None
    ref = torch.nn.functional.cross_entropy(h @ w.t(), labels, reduction="sum")
    ref.backward()
    assert n == 36
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, h.grad)


def test_chunked_loss_weights_ce_and_kl():
    """ce_weight * CE + kl_weight * KL(p_target || q_draft), each term against a dense float64 reference; ce_weight 0
    is pure distillation (its gradient pulls the draft's distribution to the target's, not to the data's token)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(21, 8, generator=g, dtype=torch.float64)
    th = torch.randn(21, 8, generator=g, dtype=torch.float64)
    w = torch.randn(30, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (21,), generator=g)
    labels[[2, 20]] = -100
    keep = labels != -100
    logq, logp = torch.log_softmax(h @ w.t(), -1), torch.log_softmax(th @ w.t(), -1)
    ce = torch.nn.functional.nll_loss(logq, labels, reduction="sum")
    kl = (logp.exp() * (logp - logq)).sum(-1)[keep].sum()
    for ce_w, kl_w in ((1.0, 0.5), (0.0, 1.0), (2.0, 0.0)):
        loss, n = chunked_lm_loss(h, w, labels, chunk=5, target_hidden=th, kl_weight=kl_w, ce_weight=ce_w)
        assert n == 19
        torch.testing.assert_close(loss, (ce_w * ce + kl_w * kl).float(), rtol=1e-5, atol=1e-5)
    for ce_w, kl_w in ((0.0, 0.0), (-1.0, 1.0), (1.0, -0.5)):
        with pytest.raises(ValueError, match=r"ce_weight \(.*\) and kl_weight \(.*\) must be >= 0"):
            chunked_lm_loss(h, w, labels, target_hidden=th, kl_weight=kl_w, ce_weight=ce_w)


# --- the loop ---------------------------------------------------------------------------------------------------


def test_loss_falls_and_checkpoint_loads(tmp_path):
    target = tiny_target()
    hist = train(config(tmp_path, steps=30, save_every=30), target, CharTokenizer())
    first, last = sum(h["loss"] for h in hist[:3]) / 3, sum(h["loss"] for h in hist[-3:]) / 3
    assert last < first - 0.5, (first, last)
    draft = LongSpecDraft.from_pretrained(tmp_path / "out" / "checkpoint-30", target=target)
    assert set(draft.state_dict()) == set(LongSpecDraft.from_target(target).state_dict())
    rows = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))


def test_resume_reproduces_the_next_steps(tmp_path):
    """An interrupted run (only checkpoint-3 survives) resumes into exactly the losses of the uninterrupted one."""
    full = train(config(tmp_path / "a", steps=6, save_every=3), tiny_target(), CharTokenizer())
    out = tmp_path / "b" / "out"
    out.mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "out" / "checkpoint-3", out / "checkpoint-3")
    (out / "latest").write_text("checkpoint-3")
    resumed = train(config(tmp_path / "b", steps=6, save_every=3), tiny_target(), CharTokenizer())
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(full[3:], resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)


def test_checkpoints_carry_the_most_frequent_training_tokens(tmp_path):
    """--draft-vocab-size N: every checkpoint holds the N most frequent tokens of the sequences trained on so far
    (draft_vocab.json, loaded by from_pretrained); a resumed run keeps counting from the checkpoint."""
    cfg = config(tmp_path / "a", steps=6, save_every=3, draft_vocab_size=10)
    target = tiny_target()
    train(cfg, target, CharTokenizer())
    stream = PackedStream(cfg.data, CharTokenizer()).iter_from(0)
    seen = torch.cat([next(stream) for _ in range(6 * cfg.batch_size)])
    counts = torch.bincount(seen, minlength=VOCAB)
    want = frequent_tokens(counts, 10)
    ckpt = tmp_path / "a" / "out" / "checkpoint-6"
    assert torch.equal(load_draft_vocab(ckpt / "draft_vocab.json"), want)
    assert torch.equal(torch.load(ckpt / "trainer_state.pt")["token_counts"], counts)
    assert torch.equal(LongSpecDraft.from_pretrained(ckpt, target=target).draft_vocab, want)
    out = tmp_path / "b" / "out"
    out.mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "out" / "checkpoint-3", out / "checkpoint-3")
    (out / "latest").write_text("checkpoint-3")
    train(config(tmp_path / "b", steps=6, save_every=3, draft_vocab_size=10), tiny_target(), CharTokenizer())
    assert torch.equal(torch.load(out / "checkpoint-6" / "trainer_state.pt")["token_counts"], counts)
    assert torch.equal(load_draft_vocab(out / "checkpoint-6" / "draft_vocab.json"), want)


def test_kl_distillation_term_runs(tmp_path):
    hist = train(config(tmp_path, steps=2, kl_weight=0.5), tiny_target(), CharTokenizer())
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    # the trainer weighs each term as asked: on the same first batch (same seed, same initial draft),
    # CE + KL = CE alone + KL alone
    first = {(ce, kl): train(config(tmp_path / f"w{ce}{kl}", steps=1, kl_weight=kl, ce_weight=ce), tiny_target(),
                             CharTokenizer())[0]["loss"] for ce, kl in ((1.0, 1.0), (1.0, 0.0), (0.0, 1.0))}
    assert 0 < first[0.0, 1.0] < first[1.0, 1.0]
    assert first[1.0, 1.0] == pytest.approx(first[1.0, 0.0] + first[0.0, 1.0], rel=1e-5)
    with pytest.raises(ValueError, match=r"ce_weight \(0.0\) and kl_weight \(0.0\) must be >= 0 and not both 0"):
        train(config(tmp_path / "none", steps=1, ce_weight=0.0), tiny_target(), CharTokenizer())


def test_bad_configuration(tmp_path):
    with pytest.raises(ValueError, match=r"data.seq_len \(96\) is longer than the target supports"):
        train(config(tmp_path), tiny_target(max_pos=64), CharTokenizer())

    class BigTokenizer(CharTokenizer):
        def __len__(self):
            return VOCAB + 10

    with pytest.raises(ValueError, match="the tokenizer has 74 tokens but the target's LM head has 64 rows"):
        train(config(tmp_path), tiny_target(), BigTokenizer())
    cfg = config(tmp_path)
    cfg.data.field = "code"
    with pytest.raises(KeyError, match="record has no field 'code'"):
        train(cfg, tiny_target(), CharTokenizer())


# --- two processes over gloo -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, cfg_full, cfg_resumed, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        full = train(cfg_full, tiny_target(), CharTokenizer())
        if rank == 0:  # only checkpoint-2 of the full run survives in the second run's directory
            out = Path(cfg_resumed.out_dir)
            shutil.copytree(Path(cfg_full.out_dir) / "checkpoint-2", out / "checkpoint-2")
            (out / "latest").write_text("checkpoint-2")
        torch.distributed.barrier()
        resumed = train(cfg_resumed, tiny_target(), CharTokenizer())
        result[rank] = ([h["loss"] for h in full], [h["step"] for h in resumed], [h["loss"] for h in resumed])
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("parallel", [Parallel.DDP, Parallel.FSDP])
def test_two_process_gloo_and_exact_resume(tmp_path, parallel):
    """Two ranks, each on its own share of the data; then a run resumed from checkpoint-2 logs the uninterrupted
    run's losses at steps 3 and 4 (both ranks' data positions, generators and the optimizer come back exactly)."""
    cfg_full = config(tmp_path / "a", steps=4, save_every=2, parallel=parallel)
    cfg_resumed = config(tmp_path / "b", steps=4, save_every=2, parallel=parallel)
    with mp.Manager() as m:
        result = m.dict()
        mp.spawn(_worker, args=(2, _free_port(), cfg_full, cfg_resumed, result), nprocs=2, join=True)
        result = dict(result)
    full, steps, resumed = result[0]
    assert result[1] == result[0]  # the logged loss is averaged across ranks
    assert steps == [3, 4] and resumed == pytest.approx(full[2:], rel=1e-6, abs=1e-7)
    draft = LongSpecDraft.from_pretrained(tmp_path / "a" / "out" / "checkpoint-4", target=tiny_target())
    assert all(torch.isfinite(p).all() for p in draft.parameters())


# --- the command line ---------------------------------------------------------------------------------------------


def _save_target_with_tokenizer(path):
    """A tiny target plus a real byte-level BPE tokenizer trained on the corpus, saved as a transformers directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"def f{i % 7}(x):\n    return x * {i % 5} + {i % 3}\n" for i in range(50)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)
    tiny_target(vocab=320).save_pretrained(path)
    return len(fast)


def test_cli_train_under_torchrun(tmp_path):
    """The user path: ``torchrun --nproc-per-node 2 -m longspec.cli train ...`` (gloo on CPU)."""
    assert _save_target_with_tokenizer(tmp_path / "target") <= 320
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "longspec.cli", "train", "--target", str(tmp_path / "target"), "--data", corpus,
           "--out", str(tmp_path / "out"), "--seq-len", "64", "--steps", "2", "--save-every", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "trained to step 2" in run.stderr
    assert (tmp_path / "out" / "checkpoint-2" / "model.safetensors").exists()
    # no --parallel: a 2-process launch implies DDP
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["parallel"] == "ddp"


def test_scaling_harness_over_gloo(tmp_path):
    """benchmarks/bench_scaling (issue 8's harness) on CPU: 1 rank vs 2 ranks (DDP and FSDP2), same global batch."""
    _save_target_with_tokenizer(tmp_path / "target")
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    cmd = [sys.executable, "-m", "benchmarks.bench_scaling", "--target", str(tmp_path / "target"), "--data", corpus,
           "--ranks", "2", "--global-batch", "4", "--steps", "4", "--seq-len", "64", "--work", str(tmp_path / "runs"),
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2],
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "scaling.json").read_text())
    logs = res["meta"]["logs"]
    assert len(logs["single"]) == 4 and [(r["mode"], r["ranks"]) for r in res["rows"]] == [("ddp", 2), ("fsdp", 2)]
    for row in res["rows"]:
        log = logs[f"{row['mode']}-{row['ranks']}"]
        assert [r["step"] for r in log] == [1, 2, 3, 4]
        # step 1: identical weights; each rank's own sequences and position/delta draws differ from the one rank's
        assert abs(log[0]["loss"] - logs["single"][0]["loss"]) < 0.5
        assert row["scaling_efficiency"] > 0
    assert (tmp_path / "scaling.png").stat().st_size > 0  # the loss curves, overlaid


def test_prefetch_keeps_order_stops_and_reraises():
    from longspec.train.data import Prefetch

    assert list(Prefetch(iter(range(50)), depth=3)) == list(range(50))
    it = Prefetch(iter([]), depth=1)
    for _ in range(2):  # exhausted stays exhausted
        with pytest.raises(StopIteration):
            next(it)

    def broken():
        yield 1
        raise ValueError("bad record in data.jsonl")

    it = Prefetch(broken())
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad record"):
        next(it)
    with pytest.raises(ValueError, match="depth"):
        Prefetch(iter([]), depth=0)
    endless = Prefetch(iter(int, 1), depth=2)  # iter(int, 1): zeros forever
    assert next(endless) == 0
    endless.close()  # returns: the thread saw the stop while blocked on the full queue
    assert not endless._thread.is_alive()
    with pytest.raises(StopIteration):
        next(endless)


def test_float32_draft_trains_against_a_bf16_target_under_autocast():
    """What the trainer does on CUDA with a bf16 target (the CLI's default): a fresh draft keeps float32 master
    weights and runs under bf16 autocast. Checked here with CPU autocast: dtypes compose and gradients are fp32."""
    from longspec.train.objective import prepare_target, step_loss

    target = tiny_target().to(torch.bfloat16)
    prepare_target(target)
    draft = LongSpecDraft.from_target(target).float().train()
    draft.cross_attn.k_proj.requires_grad_(False)  # dead weights, as in the trainer
    draft.cross_attn.v_proj.requires_grad_(False)
    ids = torch.randint(2, VOCAB, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, n = step_loss(draft, target, ids, torch.arange(96), delta=2)
    loss.backward()
    assert n == 2 * 95 and torch.isfinite(loss)
    grads = [p.grad for p in draft.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
