"""Tensor-parallel targets: a model sharded by transformers' own tensor-parallel plan, decoded on local heads.

transformers shards a Llama / Qwen2 / Qwen3 / Mistral model over a 1-D device mesh with its predefined plan
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` under ``torchrun``): q/k/v and the
MLP's gate/up projections column-wise, o_proj and down_proj row-wise (an all-reduce after each), the embeddings by
vocabulary (all-reduce) and the LM head column-wise with its logits gathered. Rank r then computes the attention of
its contiguous slice of query heads ``[r * Hq/K, (r+1) * Hq/K)``, whose KV heads are exactly
``[r * Hkv/K, (r+1) * Hkv/K)`` (query head h reads KV head ``h // (Hq/Hkv)``). longspec adds nothing to that engine:
its attention function already receives the local heads, so the KV cache is allocated with ``Hkv / K`` heads per
rank (:class:`TensorParallel` rides on the cache), and every rank runs the same decoding loop on the same (gathered,
hence identical) logits. Collectives are all inside transformers' plan, except the LongSpec draft's cross-attention
(:func:`gather_heads`, see :meth:`longspec.model.draft.LongSpecDraft.finish`).

CPU runs use the gloo backend (the tests decode 2 ranks token for token against one process); NCCL on GPUs is the
same code but untested on GPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .geometry import attention_modules, num_kv_heads

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class TensorParallel:
    """This rank's share of the attention heads of a tensor-parallel target.

    mesh: the 1-D tensor-parallel :class:`~torch.distributed.device_mesh.DeviceMesh` the weights are sharded on.
    rank, world: this rank's index on it and its size K.
    num_heads, num_kv_heads: the model's query / KV head counts (all ranks together).
    """

    mesh: "DeviceMesh"
    rank: int
    world: int
    num_heads: int
    num_kv_heads: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.world

    def local_query(self, q: Tensor) -> Tensor:
        """This rank's query heads of ``q [B, S, Hq, D]`` (a view): the heads whose KV heads this rank holds."""
        h = self.local_heads
        return q[:, :, self.rank * h:(self.rank + 1) * h]


def check_head_split(config: "PretrainedConfig", world: int) -> None:
    """Raise ``ValueError`` naming the head count unless ``world`` ranks can split the attention by whole heads."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the tensor-parallel size must be an int >= 1, got {world!r}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, heads in (("num_attention_heads", text.num_attention_heads), ("num_key_value_heads", num_kv_heads(text))):
        if heads % world:
            raise ValueError(f"tensor parallelism over {world} ranks shards attention by heads, but the target's "
                             f"{name} ({heads}) is not divisible by {world}; use a tensor-parallel size that "
                             f"divides {heads}")


def tensor_parallel(model: "PreTrainedModel") -> Optional[TensorParallel]:
    """The head layout of ``model`` when transformers sharded its attention by heads (else None: a whole model).

    Raises ``ValueError`` for a layout longspec cannot decode: attention projections sharded other than q/k/v
    column-wise and o_proj row-wise on one 1-D mesh, or head counts the mesh does not divide.
    """
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor, Shard

    modules = attention_modules(model)
    first = modules[0].k_proj.weight
    if not isinstance(first, DTensor):
        if any(isinstance(getattr(m, p).weight, DTensor) for m in modules for p in ("q_proj", "v_proj", "o_proj")):
            raise ValueError("longspec: the target's attention is partly sharded (k_proj whole, other projections "
                             "DTensors); shard q/k/v column-wise and o_proj row-wise (transformers' tp_plan) or none")
        return None
    mesh = first.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"longspec: the target's attention weights are sharded over a {mesh.ndim}-D mesh "
                         f"{mesh.mesh_dim_names}; decoding supports tensor parallelism on a 1-D mesh only")
    want = {"q_proj": Shard(0), "k_proj": Shard(0), "v_proj": Shard(0), "o_proj": Shard(1)}
    for i, m in enumerate(modules):
        for name, placement in want.items():
            w = getattr(m, name).weight
            if not isinstance(w, DTensor) or w.device_mesh != mesh or tuple(w.placements) != (placement,):
                got = tuple(w.placements) if isinstance(w, DTensor) else "a whole tensor"
                raise ValueError(f"longspec: layer {i}'s self_attn.{name} is sharded as {got}; tensor-parallel "
                                 f"decoding needs q/k/v_proj as (Shard(dim=0),) and o_proj as (Shard(dim=1),) on "
                                 "one mesh (transformers' predefined tp_plan)")
    text = model.config.get_text_config()
    world = mesh.size()
    check_head_split(text, world)
    return TensorParallel(mesh, mesh.get_local_rank(), world, text.num_attention_heads, num_kv_heads(text))


def gather_heads(local: Tensor, tp: TensorParallel) -> Tensor:
    """``[B, S, Hq/K, D]`` per rank -> ``[B, S, Hq, D]`` on every rank (rank r's heads at ``[r * Hq/K, ...)``).

    A DTensor redistribution (an all-gather over the mesh), so it also traces under ``torch.compile``."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local.contiguous(), tp.mesh, [Shard(2)], run_check=False).full_tensor()


def world_size() -> int:
    """The launch's process count (``torchrun`` sets ``WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_tensor_parallel(path: str | os.PathLike, dtype: torch.dtype, **kwargs) -> "PreTrainedModel":
    """``AutoModelForCausalLM.from_pretrained(path)`` sharded over every rank of the ``torchrun`` launch with the
    model's predefined tensor-parallel plan (each rank reads only its shards; transformers initialises the process
    group: NCCL on GPUs, gloo on CPU). The head counts are checked against the launch first."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(
        path, **{k: v for k, v in kwargs.items() if k in ("local_files_only", "gguf_file", "trust_remote_code")})
    check_head_split(config, world_size())
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                 distributed_config=DistributedConfig(tp_plan="auto"), **kwargs)
    return model.eval()


__all__ = ["TensorParallel", "check_head_split", "gather_heads", "load_tensor_parallel", "tensor_parallel",
           "world_size"]
