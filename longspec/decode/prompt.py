"""What a generate call takes in and gives back: the prompt batch left-aligned, the stop and pad ids, and the
output sequences assembled from the decoding state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Prompt:
    """A validated prompt batch.

    tokens:  int64 ``[B, S]`` left-aligned (token j of a row at column j), filler 0 after each row's end.
    lens:    int64 ``[B]`` tokens per row.
    max_len: ``int(lens.max())``.
    """

    tokens: Tensor
    lens: Tensor
    max_len: int


def prepare_prompt(input_ids: Tensor, attention_mask: Optional[Tensor], device: torch.device) -> Prompt:
    """Validate and left-align a (left-padded) batch ``input_ids`` (int ``[B, S]``; ``attention_mask`` 1 = token)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor [B, S], got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} {tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must hold at least one token per row, got shape {tuple(input_ids.shape)}")
    ids = input_ids.to(device=device, dtype=torch.int64)
    if attention_mask is None:
        lens = torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64, device=device)
        return Prompt(ids, lens, ids.shape[1])
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(device=device) != 0
    lens = mask.sum(dim=1)
    # left padding: every row is zeros then ones, i.e. its ones are exactly its last lens[b] columns
    col = torch.arange(ids.shape[1], device=device)[None, :]
    if not bool(torch.equal(mask, col >= ids.shape[1] - lens[:, None])) or bool((lens == 0).any()):
        raise ValueError("attention_mask must mark left padding (zeros then ones in every row) and every row needs "
                         "at least one token")
    shift = (ids.shape[1] - lens)[:, None]
    aligned = ids.gather(1, (col + shift).clamp(max=ids.shape[1] - 1))
    aligned = torch.where(col < lens[:, None], aligned, 0)
    max_len = int(lens.max())
    return Prompt(aligned[:, :max_len], lens, max_len)


def _as_id_list(ids) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def eos_ids(eos_token_id, model) -> Tensor:
    """The stop ids (int64 ``[E]``, may be empty): the argument, else the model's generation config, else its
    config."""
    device = model.get_output_embeddings().weight.device
    if eos_token_id is not None:
        ids = _as_id_list(eos_token_id)
    else:
        gen = getattr(model, "generation_config", None)
        ids = _as_id_list(getattr(gen, "eos_token_id", None)) or _as_id_list(getattr(model.config, "eos_token_id", None))
    return torch.tensor(ids, dtype=torch.int64, device=device)


def pad_id(model, eos: Tensor) -> int:
    """The id written after a row stops: pad_token_id from the generation config or config, else the first EOS."""
    gen = getattr(model, "generation_config", None)
    for source in (gen, model.config):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    return int(eos[0]) if eos.numel() else 0


def output_sequences(input_ids: Tensor, prompt: Prompt, tokens: Tensor, generated: Tensor, pad: int) -> Tensor:
    """``[B, S_in + G]``: the input as given, then each row's ``generated[b]`` tokens (from the state's ``tokens``,
    after its prompt), padded with ``pad`` after each row's end (G = the longest row's count)."""
    G = int(generated.max())
    col = torch.arange(G, device=input_ids.device)[None, :]
    gen = tokens.gather(1, prompt.lens[:, None] + col)
    gen = torch.where(col < generated[:, None], gen, pad)
    return torch.cat([input_ids.to(torch.int64), gen], dim=1)
