"""Tensor-parallel decoding (issue 23) on CPU: 2 ranks over gloo, the target sharded by transformers' own tp_plan.

Every output must equal the single-process output token for token (float32): plain decoding, the LongSpec draft
(whose cross-attention runs on each rank's KV heads and gathers), with a reduced drafting vocabulary, REFEED and
seeded sampling, and the streaming self-drafter (which reads every layer's local heads). The command line is run
under ``torchrun`` the way a user would. The same ranks also build what ``benchmarks/bench_step_latency --tp`` times
(a random target sharded with no checkpoint, :func:`longspec.testing.random_tensor_parallel`) and run its rounds.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from longspec import LongSpecDraft, LongSpecDrafter, SpeculativeDecoder, StreamingSelfDrafter
from longspec.decode.decoder import KVUpdate
from longspec.model.parallel import check_head_split

from .conftest import TARGET_FAMILY
from .tiny_targets import ragged_batch, tiny_target

WORLD = 2
DRAFT_VOCAB = torch.arange(3, 192, 2)  # every other token: the tree draws from a reduced vocabulary
CASES = {  # name: (family, drafter kind, decoder kwargs, generate kwargs)
    "plain": ("llama-gqa-d64", None, {}, {}),
    "longspec": ("llama-gqa-d64", "longspec", {"tree_shape": (2, 4, 4)}, {}),
    "longspec-vocab-refeed-sampled": ("llama-gqa-d64", "longspec-vocab",
                                      {"tree_shape": (2, 4, 4), "kv_update": KVUpdate.REFEED},
                                      {"temperature": 0.8, "top_p": 0.9, "seed": 7}),
    "streaming": ("llama-gqa-d64", "streaming", {"tree_shape": (1, 1, 1)}, {}),
    "longspec-qwen2-biases": ("qwen2-mha-d128", "longspec", {"tree_shape": (2, 2)}, {}),
}
NEW = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drafter(kind, target, draft_dir):
    if kind is None:
        return None
    if kind == "streaming":
        return StreamingSelfDrafter(sink=4, window=8)
    draft = LongSpecDraft.from_pretrained(draft_dir, target=target)
    if kind == "longspec-vocab":
        draft.set_draft_vocab(DRAFT_VOCAB)
    return LongSpecDrafter(draft)


def _decode_all(load, dirs) -> dict:
    ids, mask = ragged_batch([37, 30], seed=3, period=9)
    out, decoders = {}, {}
    for name, (family, kind, dec_kwargs, gen_kwargs) in CASES.items():
        target = load(family)
        dec = SpeculativeDecoder(target, _drafter(kind, target, dirs[family][1]), **dec_kwargs)
        out[name] = dec.generate(ids, NEW, attention_mask=mask, **gen_kwargs).sequences
        decoders[name] = dec
    return out, decoders


def _random_tp_rounds() -> dict:
    """bench_step_latency --tp in small: a random sharded target, the draft replicated, synthetic rounds."""
    from longspec.testing import random_tensor_parallel

    target = random_tensor_parallel(tiny_target("llama-gqa-d64").config, torch.float32)
    torch.manual_seed(0)
    dec = SpeculativeDecoder(target, LongSpecDrafter(LongSpecDraft.from_target(target)), tree_shape=(2, 2))
    run = dec.synthetic_run(40, rounds=3)
    with dec.rounds():
        for _ in range(3):
            dec.step(run)
    q = target.model.layers[0].self_attn.q_proj.weight
    return {"local_q": tuple(q.to_local().shape), "tokens": run.state.tokens.clone(),
            "seqlens": run.state.seqlens.clone()}


def _worker(rank, port, dirs, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    from longspec.model.parallel import load_tensor_parallel

    try:
        models = {}

        def load(family):
            if family not in models:
                models[family] = load_tensor_parallel(dirs[family][0], torch.float32)
            return models[family]

        out, decoders = _decode_all(load, dirs)
        tp = decoders["longspec"].tp
        kv_heads = {name: tuple(dec._cache.kv.shape[-2:]) for name, dec in decoders.items()}
        errors = []
        try:  # unseeded sampling cannot agree across ranks
            decoders["plain"].generate(torch.ones(1, 4, dtype=torch.long), 2, temperature=1.0)
        except ValueError as err:
            errors.append(str(err))
        try:  # one KV head cannot be split over two ranks: refused before loading
            load_tensor_parallel(dirs["qwen3-gqa-d128"][0], torch.float32)
        except ValueError as err:
            errors.append(str(err))
        result[rank] = {"out": out, "tp": (tp.rank, tp.world, tp.local_heads, tp.local_kv_heads),
                        "kv": kv_heads, "errors": errors, "random": _random_tp_rounds()}
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Saved tiny targets (and a random LongSpec draft each), as a tensor-parallel launch loads them."""
    out = {}
    for family in ("llama-gqa-d64", "qwen2-mha-d128", "qwen3-gqa-d128"):
        root = tmp_path_factory.mktemp(family)
        target = tiny_target(family)
        target.save_pretrained(root / "target")
        torch.manual_seed(1)
        LongSpecDraft.from_target(target).save_pretrained(root / "draft")
        out[family] = (str(root / "target"), str(root / "draft"))
    return out


def test_two_rank_tensor_parallel_decoding_equals_one_process(dirs):
    with mp.Manager() as m:
        result = m.dict()
        mp.spawn(_worker, args=(_free_port(), dirs, result), nprocs=WORLD, join=True)
        result = dict(result)
    models = {}
    want, _ = _decode_all(lambda f: models.setdefault(f, AutoModelForCausalLM.from_pretrained(
        dirs[f][0], dtype=torch.float32).eval()), dirs)
    for rank in range(WORLD):
        got = result[rank]
        assert got["tp"] == (rank, WORLD, 2, 1)  # llama 4/2 heads: 2 query heads and 1 KV head per rank
        assert got["kv"]["longspec"] == (1, 64) and got["kv"]["longspec-qwen2-biases"] == (1, 128)
        for name in CASES:
            assert torch.equal(got["out"][name], want[name]), (rank, name)
        assert "sampling from a tensor-parallel target needs seed=" in got["errors"][0]
        assert "num_key_value_heads (1) is not divisible by 2" in got["errors"][1]
    # the benchmark's random sharded target: each rank holds half the query rows, and the ranks decode alike
    randoms = [result[rank]["random"] for rank in range(WORLD)]
    assert randoms[0]["local_q"] == (2 * 64, 64)  # q_proj [Hq * D, H]: 2 of the 4 heads of 64
    assert torch.equal(randoms[0]["tokens"], randoms[1]["tokens"]) and (randoms[0]["seqlens"] > 40).all()
    # the cases tell apart what they claim to test: the drafters accepted drafts, sampling differs from greedy
    assert not torch.equal(want["longspec"], want["longspec-vocab-refeed-sampled"])


def test_head_split_errors_name_the_head_count():
    config = tiny_target("qwen3-gqa-d128").config
    with pytest.raises(ValueError, match=r"num_key_value_heads \(1\) is not divisible by 2"):
        check_head_split(config, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by 3"):
        check_head_split(config, 3)
    with pytest.raises(ValueError, match="tensor-parallel size must be an int >= 1"):
        check_head_split(config, 0)
    check_head_split(tiny_target("llama-gqa-d64").config, 2)


def test_generate_under_torchrun_prints_what_one_process_prints(model_dir, prompt_file, tmp_path, capsys):
    """The user path: ``torchrun --nproc-per-node 2 -m longspec.cli generate ...`` prints (on rank 0 only) the text
    a single process prints."""
    from longspec.cli import main

    torch.manual_seed(1)
    LongSpecDraft.from_target(tiny_target(TARGET_FAMILY)).save_pretrained(tmp_path / "draft")
    args = ["generate", "--target", str(model_dir), "--draft", str(tmp_path / "draft"), "--prompt-file",
            str(prompt_file), "--max-new-tokens", "12", "--dtype", "float32", "--tree-shape", "2", "2"]
    assert main(args) == 0
    want = capsys.readouterr().out
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
           str(_free_port()), "-m", "longspec.cli", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == want and want.strip()
    assert "tensor-parallel=2" in run.stderr


def test_generate_refuses_what_a_tensor_parallel_launch_cannot_take(model_dir, prompt_file, capsys, monkeypatch):
    """Checked before torch loads anything, on every rank alike (here: one process that believes it is rank 0 of 2)."""
    from longspec.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["generate", "--target", str(model_dir), "--prompt-file", str(prompt_file)]
    assert main([*base, "--device", "cpu"]) == 2
    assert "--device cpu: under a 2-process launch each rank uses the GPU of its LOCAL_RANK" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")  # the tiny llama has 4 query and 2 KV heads
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "under a 4-process launch: tensor parallelism over 4 ranks" in err
    assert "num_key_value_heads (2) is not divisible by 4" in err
