"""The code pair recipe's export: the shipped pair (bf16 target, draft, tokenizer) under its size limit
(:mod:`longspec.recipes.code_pair`)."""
from __future__ import annotations

import os
import shutil

import torch

from longspec.recipes.pair_config import SHIP_LIMIT_BYTES, _read_json, _write_json


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def export_pair(out: str, dest: str, limit_bytes: int = SHIP_LIMIT_BYTES) -> dict:
    """Copy the recipe's target (bf16, with tokenizer) and main draft (cast to bf16) to ``dest/target`` and
    ``dest/draft``, with ``dest/pair.json`` (a summary of ``recipe.json``): the layout ``longspec.pretrained`` loads.
    Raises ValueError when the pair would exceed ``limit_bytes`` (the shipped files stay under 40 MB)."""
    from safetensors.torch import load_file, save_file

    record = _read_json(os.path.join(out, "recipe.json"))
    if "draft" not in record:
        raise ValueError(f"{out} holds no trained draft: run the recipe's 'drafts' stage first")
    os.makedirs(dest, exist_ok=True)
    target_out = os.path.join(dest, "target")
    shutil.rmtree(target_out, ignore_errors=True)
    shutil.copytree(os.path.join(out, "target"), target_out)
    draft_out = os.path.join(dest, "draft")
    os.makedirs(draft_out, exist_ok=True)
    ckpt = record["draft"]["checkpoint"]
    config = _read_json(os.path.join(ckpt, "config.json"))
    _write_json(os.path.join(draft_out, "config.json"), {**config, "dtype": "bfloat16"})
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()},
              os.path.join(draft_out, "model.safetensors"), metadata={"format": "pt"})
    for name in ("draft_vocab.json",):
        if os.path.isfile(os.path.join(ckpt, name)):
            shutil.copy2(os.path.join(ckpt, name), draft_out)
    summary = {"scale": record["scale"]["name"], "device": record["device"], "torch": record["torch"],
               "corpus": record["corpus"], "heldout_frac": record["scale"]["heldout_frac"],
               "target": {k: record["target"][k] for k in ("params", "steps", "tokens_seen", "heldout_loss")}
               | {"final_loss": record["target"]["loss"]["last"]},
               "draft": {k: record["draft"][k] for k in ("steps", "tokens_seen")}
               | {"final_loss": record["draft"]["loss"]["last"]},
               "wall_s": record["wall_s"]}
    if record["target"].get("heldout_loss_by_context"):
        summary["target"]["heldout_loss_by_context"] = record["target"]["heldout_loss_by_context"]
    if record["draft"].get("heldout_loss"):
        summary["draft"] |= {"run": record["draft"]["run"], "heldout_loss": record["draft"]["heldout_loss"],
                             "target_heldout_loss": record.get("draft_heldout_loss", {}).get("target")}
    if "init" in record:  # long-context mode: what it continued and what it changed
        summary["init"] = {k: {"dir": v["dir"], "sha256": v["sha256"]} for k, v in record["init"].items()}
        summary["target"] |= {k: record["target"][k] for k in ("rope_theta", "max_position_embeddings", "windows",
                                                                "steps_per_window")}
        summary["target"]["heldout_loss_by_context_before"] = record["init"]["target"].get("heldout_loss")
    _write_json(os.path.join(dest, "pair.json"), summary)
    size = _tree_bytes(target_out) + _tree_bytes(draft_out) + os.path.getsize(os.path.join(dest, "pair.json"))
    if size > limit_bytes:
        raise ValueError(f"the exported pair in {dest} is {size / 1e6:.1f} MB, over the {limit_bytes / 1e6:.0f} MB "
                         "the package ships")
    summary["bytes"] = size
    return summary
