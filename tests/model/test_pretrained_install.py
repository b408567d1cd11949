"""After a plain (non-editable) install, ``python -m longspec.pretrained`` points at the installed pair, so the
README's ``longspec generate --target "$(python -m longspec.pretrained target)" ...`` works outside a clone."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import longspec.pretrained

REPO = Path(__file__).resolve().parents[2]


def test_the_pair_ships_in_the_installed_package(tmp_path):
    src, site = tmp_path / "src", tmp_path / "site"  # built from a copy: the build writes build/ and egg-info
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests",
                                                             "benchmarks", "*-out", "*-runs", "*-carry"))
    env = {**os.environ, "LONGSPEC_BUILD_EXT": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(site), str(src)], capture_output=True, text=True, env=env,
                             timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    env["PYTHONPATH"] = str(site)
    paths = {}
    for part in ("target", "draft"):
        run = subprocess.run([sys.executable, "-m", "longspec.pretrained", part], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=120)
        assert run.returncode == 0, run.stderr
        paths[part] = Path(run.stdout.strip())
        assert paths[part].is_relative_to(site), paths[part]  # the installed copy, not this checkout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (paths["target"] / name).is_file(), name
    for name in ("config.json", "model.safetensors"):
        assert (paths["draft"] / name).is_file(), name
    assert (paths["target"] / "model.safetensors").read_bytes() == \
        (longspec.pretrained.pair_path("target") / "model.safetensors").read_bytes()
    bad = subprocess.run([sys.executable, "-m", "longspec.pretrained", "tokenizer"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode != 0 and "usage: python -m longspec.pretrained [target | draft]" in bad.stderr
