"""Training runs as a user meets them: resume with gradient accumulation, the log and config a run leaves, the run
directory as a checkpoint, a rerun of a finished run, and the --parallel default."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from longspec.cli import main
from longspec.cli_train import launch_parallel
from longspec.inputs import CLIError
from longspec.model.draft import LongSpecDraft
from longspec.train.trainer import train

from .test_train import CharTokenizer, _save_target_with_tokenizer, config, tiny_target, write_corpus


def _interrupt(full_out, resumed_out, at: int) -> None:
    """Make ``resumed_out`` what an interrupted run leaves: its log as far as it got, checkpoint-``at`` only."""
    resumed_out.mkdir(parents=True)
    shutil.copytree(full_out / f"checkpoint-{at}", resumed_out / f"checkpoint-{at}")
    shutil.copy(full_out / "log.jsonl", resumed_out / "log.jsonl")
    (resumed_out / "latest").write_text(f"checkpoint-{at}")


def _log_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def test_resume_with_gradient_accumulation_continues_at_the_next_batch(tmp_path):
    """Step s consumed s * grad_accum micro-batches: the resumed run must read on from there, not from batch s."""
    full = train(config(tmp_path / "a", steps=3, save_every=2, grad_accum=2), tiny_target(), CharTokenizer())
    _interrupt(tmp_path / "a" / "out", tmp_path / "b" / "out", at=2)
    resumed = train(config(tmp_path / "b", steps=3, save_every=2, grad_accum=2), tiny_target(), CharTokenizer())
    assert [r["step"] for r in resumed] == [3]
    for a, b in zip(full[2:], resumed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)


def test_a_resumed_run_logs_every_step_once(tmp_path):
    train(config(tmp_path / "a", steps=4, save_every=2), tiny_target(), CharTokenizer())
    out = tmp_path / "b" / "out"
    _interrupt(tmp_path / "a" / "out", out, at=2)
    assert _log_steps(out) == [1, 2, 3, 4]  # logged past the checkpoint before the interruption
    train(config(tmp_path / "b", steps=4, save_every=2), tiny_target(), CharTokenizer())
    assert _log_steps(out) == [1, 2, 3, 4]


def test_the_run_directory_loads_as_its_latest_checkpoint(tmp_path):
    target = tiny_target()
    train(config(tmp_path, steps=2, save_every=1), target, CharTokenizer())
    out = tmp_path / "out"
    assert (out / "latest").read_text() == "checkpoint-2"
    run_dir = LongSpecDraft.from_pretrained(out, target=target).state_dict()
    last = LongSpecDraft.from_pretrained(out / "checkpoint-2", target=target).state_dict()
    first = LongSpecDraft.from_pretrained(out / "checkpoint-1", target=target).state_dict()
    assert all(torch.equal(run_dir[k], last[k]) for k in last)
    assert not all(torch.equal(run_dir[k], first[k]) for k in first)


def test_train_config_json_stores_the_parallel_mode_by_value(tmp_path):
    train(config(tmp_path, steps=1, save_every=1), tiny_target(), CharTokenizer())
    saved = json.loads((tmp_path / "out" / "train_config.json").read_text())
    assert saved["parallel"] == "none" and saved["steps"] == 1 and saved["data"]["seq_len"] == 96


def test_the_parallel_default_follows_the_launch():
    assert launch_parallel(None, 1) == "none"
    assert launch_parallel(None, 2) == "ddp"
    assert launch_parallel("fsdp", 4) == "fsdp"
    with pytest.raises(CLIError, match=r"--parallel ddp needs several processes: launch with torchrun"):
        launch_parallel("ddp", 1)
    with pytest.raises(CLIError, match=r"--parallel none under a 2-process launch would train 2 separate drafts"):
        launch_parallel("none", 2)


# -- the command ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    _save_target_with_tokenizer(path)
    return path


def _train_argv(target_dir, tmp_path, *extra) -> list[str]:
    return ["train", "--target", str(target_dir), "--data", write_corpus(tmp_path / "corpus.jsonl"),
            "--out", str(tmp_path / "out"), "--seq-len", "64", "--steps", "2", "--save-every", "2", *extra]


def test_a_single_process_trains_without_parallel_and_a_rerun_has_nothing_to_do(target_dir, tmp_path, capsys):
    assert main(_train_argv(target_dir, tmp_path)) == 0
    err = capsys.readouterr().err
    assert "trained to step 2: loss " in err and "nan" not in err
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["parallel"] == "none"
    before = (tmp_path / "out" / "log.jsonl").read_text()
    # the rerun is answered before torch is imported, and leaves the run as it was
    code = ("import sys; from longspec.cli import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    rerun = subprocess.run([sys.executable, "-c", code, *_train_argv(target_dir, tmp_path)], capture_output=True,
                           text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{tmp_path / 'out'} already holds a run trained to step 2 (--steps 2): nothing to do" in rerun.stderr
    assert "nan" not in rerun.stderr
    assert (tmp_path / "out" / "log.jsonl").read_text() == before


def test_bad_training_input_is_one_line_and_loses_nothing(target_dir, tmp_path, capsys):
    out = tmp_path / "out"
    cases = {
        "--parallel ddp needs several processes": _train_argv(target_dir, tmp_path, "--parallel", "ddp"),
        f"--data '{tmp_path / 'none'}/*.jsonl' matches no file":
            ["train", "--target", str(target_dir), "--data", f"{tmp_path / 'none'}/*.jsonl", "--out", str(out)],
        "argument --grad-accum: must be an integer >= 1, got 0": _train_argv(target_dir, tmp_path, "--grad-accum", "0"),
        "argument --lr: must be a finite number > 0, got 0": _train_argv(target_dir, tmp_path, "--lr", "0"),
        f"--target '{tmp_path / 'nope'}' does not exist":
            ["train", "--target", str(tmp_path / "nope"), "--data", "x", "--out", str(out)],
    }
    for message, argv in cases.items():
        assert main(argv) == 2, message
        err = capsys.readouterr().err.strip()
        assert err.startswith("longspec: error: ") and "\n" not in err and message in err, (message, err)
        assert not out.exists(), message  # nothing written for a refused command


def test_a_widened_draft_trains_and_resumes_at_its_width(target_dir, tmp_path, capsys):
    """--draft-intermediate widens the --draft-init draft before training (and --draft-add-cross-blocks appends
    blocks); a rerun with more --steps resumes from the run's own checkpoint at that width, with those blocks,
    without the flags (the init draft is not loaded again)."""
    assert main(_train_argv(target_dir, tmp_path)) == 0
    units = json.loads((tmp_path / "out" / "checkpoint-2" / "config.json").read_text())["intermediate_size"]
    wide = tmp_path / "wide"
    argv = ["train", "--target", str(target_dir), "--data", str(tmp_path / "corpus.jsonl"), "--out", str(wide),
            "--seq-len", "64", "--save-every", "1", "--draft-init", str(tmp_path / "out")]
    assert main([*argv, "--steps", "1", "--draft-intermediate", str(2 * units), "--draft-add-cross-blocks", "1"]) == 0
    assert main([*argv, "--steps", "2"]) == 0
    assert "trained to step 2" in capsys.readouterr().err
    config = json.loads((wide / "checkpoint-2" / "config.json").read_text())
    assert config["intermediate_size"] == 2 * units and config["extra_cross_blocks"] == 1
    refused = {"--draft-intermediate widens the --draft-init draft: give --draft-init too":
               [*argv[:5], "--out", str(tmp_path / "a"), "--draft-intermediate", "64"],
               "--draft-add-cross-blocks grows the --draft-init draft: give --draft-init too":
               [*argv[:5], "--out", str(tmp_path / "a"), "--draft-add-cross-blocks", "1"],
               f"--draft-intermediate {units // 2}: intermediate_size must be an int larger than the draft's ({units})":
               [*argv[:5], "--out", str(tmp_path / "b"), *argv[7:], "--draft-intermediate", str(units // 2)]}
    for message, bad in refused.items():
        assert main(bad) == 2, message
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after the target's loading progress, if any
        assert err.startswith("longspec: error: ") and message in err, (message, err)
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written
