"""Helpers for checking losslessness on your own models and drafters, and what the project's tests and benchmarks
both use (published model shapes, random beam trees, the CUDA marker).

Exact token equality is the test at float32. In bf16 (or any low precision), speculative and plain decoding run
different kernels (a tree-verify forward against single-token decode steps), so near-ties of the next-token logits
may flip; :func:`first_divergence` locates where two outputs part and measures how close to a tie that point was
under a higher-precision copy of the target, so a test can require that outputs differ only at genuine ties.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Divergence:
    """Where two generated batches first differ, and the reference model's top-2 logit margin there."""

    row: int
    column: int
    margin: float


def first_difference(got: Tensor, want: Tensor) -> Optional[int]:
    """The first column (over all rows) at which two token batches ``[B, T]`` differ; the shorter width when one is
    a prefix of the other; None when they are equal."""
    if got.shape == want.shape and torch.equal(got, want):
        return None
    width = min(got.shape[-1], want.shape[-1])
    differ = (got[..., :width] != want[..., :width]).nonzero()
    return int(differ[:, -1].min()) if len(differ) else width


@torch.no_grad()
def first_divergence(got: Tensor, want: Tensor, reference_model, attention_mask: Optional[Tensor] = None
                     ) -> Optional[Divergence]:
    """None when ``got`` equals ``want`` (int64 ``[B, S + G]``); else the first differing (row, column) and the
    top-2 logit margin of ``reference_model`` (e.g. a float32 copy of the target) on the agreed prefix.

    ``attention_mask`` (``[B, S]``, 1 = token) marks left padding of the prompt, as given to ``generate``.
    """
    if got.shape == want.shape and torch.equal(got, want):
        return None
    width = min(got.shape[1], want.shape[1])
    diff = (got[:, :width] != want[:, :width]).nonzero()
    if len(diff) == 0:  # one is a prefix of the other: no next-token choice to measure
        return Divergence(0, width, float("nan"))
    b, t = diff[0].tolist()
    prefix = want[b:b + 1, :t]
    if attention_mask is None:
        mask = torch.ones_like(prefix)
    else:
        S = attention_mask.shape[1]
        mask = torch.cat([attention_mask[b:b + 1, :t], prefix.new_ones(1, max(0, t - S))], dim=1)
    logits = reference_model(prefix, attention_mask=mask).logits[0, -1].float()
    top2 = logits.topk(2).values
    return Divergence(b, t, float(top2[0] - top2[1]))


# --- shared by the tests and the benchmarks ---------------------------------------------------------------------------

# Published architecture values (config.json of meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-32B and Qwen/Qwen2.5-72B).
PUBLISHED_CONFIGS = {
    "Llama-3-8B": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False},
    "Qwen2.5-32B": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
                    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False},
    # ~72.7B parameters (145 GB in bf16): does not fit one H200; tensor-parallel only (random_tensor_parallel)
    "Qwen2.5-72B": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False},
}


def published_target(name: str, device: str | torch.device = "cuda", max_positions: int = 262144,
                     dtype: torch.dtype = torch.bfloat16, tensor_parallel: bool = False, **overrides):
    """A random-weight causal LM of a published shape (:data:`PUBLISHED_CONFIGS`), eval mode, built on ``device``
    (``"meta"`` allocates nothing). ``max_position_embeddings`` is raised to ``max_positions`` (the long-context
    variants LongSpec used, e.g. Llama-3-8B-Instruct-262k); a step's cost does not depend on the weights.
    ``overrides`` replace config fields (e.g. ``num_hidden_layers=4``: a few of the model's layers, to time a
    per-layer cost where the whole model's cache would not fit). ``tensor_parallel``: under ``torchrun``, sharded
    over the launch's ranks (:func:`random_tensor_parallel`; ``device`` is then each rank's own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {**PUBLISHED_CONFIGS[name], **overrides}
    cfg = AutoConfig.for_model(values.pop("model_type"), **values, max_position_embeddings=max_positions)
    if tensor_parallel:
        return random_tensor_parallel(cfg, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def random_tensor_parallel(config, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A random-weight causal LM for ``config`` sharded over every rank of the ``torchrun`` launch by transformers'
    predefined tensor-parallel plan, as :func:`longspec.model.parallel.load_tensor_parallel` shards a checkpoint,
    but with no checkpoint: built on the meta device, sharded there, then each rank allocates and fills only its
    shards (a 72B model never exists whole anywhere). Every rank draws the same values for the same local shapes,
    so replicated weights (norms) agree across ranks. transformers sets up the process group and each rank's
    device (``LOCAL_RANK``'s GPU, else the CPU)."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from longspec.model.parallel import check_head_split, world_size

    check_head_split(config, world_size())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    cls = type(model)
    dist_config, device_map, mesh = cls.prepare_distribute_model(DistributedConfig(tp_plan="auto"))
    model = cls.maybe_distribute_model(model, dist_config, mesh)
    device = torch.device(device_map) if device_map is not None else torch.device("cpu")
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            elif name.endswith("bias"):
                local.zero_()
            else:
                local.normal_(0.0, config.initializer_range, generator=gen)
        with torch.device(device):  # RoPE's inv_freq buffers were left on the meta device
            model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    return model.eval()


def beam_tree_mask(shape, batch: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """A random beam tree of the given level sizes (like 4-16-16-16-16): bool ``[batch, T, T]``, ancestors + self."""
    offsets = [0, 1]
    for s in shape:
        offsets.append(offsets[-1] + s)
    T = offsets[-1]
    mask = torch.zeros(batch, T, T, dtype=torch.bool)
    mask[:, 0, 0] = True
    for b in range(batch):
        for d in range(1, len(offsets) - 1):
            lo, hi = offsets[d - 1], offsets[d]
            for i in range(offsets[d], offsets[d + 1]):
                parent = int(torch.randint(lo, hi, (1,), generator=generator))
                mask[b, i] = mask[b, parent]
                mask[b, i, i] = True
    return mask


def skip_cuda_tests_without_a_gpu(items) -> None:
    """The body of a ``pytest_collection_modifyitems`` hook: on a machine without CUDA, items marked
    ``requires_cuda`` are collected and skipped."""
    import pytest

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
