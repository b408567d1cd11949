"""The target model adapter: a static KV cache and an attention function registered with transformers.

No model file is forked. :func:`longspec_attention` is registered as the ``"longspec"`` implementation of
transformers' ``AttentionInterface``; inside :func:`use_longspec_attention` the model routes every attention call
there, with an explicit :class:`AttentionStep` passed as the ``longspec_step`` forward kwarg (transformers forwards
unknown kwargs to the attention function unchanged, and builds no mask for an implementation that has no entry in
``AttentionMaskInterface``). The step says what to do:

* ``Phase.EXTEND``: S new tokens per row are appended after the committed rows. Their K/V are written at cache rows
  ``seqlens[b] + [0, S)`` and query i attends causally to rows ``[0, seqlens[b] + i]`` through ``prefix_attn``
  (per-query lengths). Prefill (``seqlens = 0``) and plain one-token decoding are this phase.
* ``Phase.TREE``: T tree tokens under a boolean mask. Their K/V are written at scratch rows ``seqlens[b] + [0, T)``
  (so ``commit_kv_`` can compact the accepted path afterwards) and attention is ``hybrid_tree_attn`` over the
  committed rows ``[0, seqlens[b])`` plus the tree block: a rejected node is never visible to a later round.

With ``invariant=True`` (:mod:`longspec.model.invariant`) both phases attend through ``invariant_attn`` instead:
each query sees the committed rows and then its ancestors' rows in depth order (for EXTEND, the tokens before it),
the key sequence plain decoding sees at that token, reduced in an order that does not depend on the forward's width.

Layout: the cache holds every layer's K and V in one contiguous tensor ``kv [L, 2, B, N, Hkv, D]`` (flash-attn
layout per layer); token j of a row sits at cache row j and absolute (RoPE) position j. For a tensor-parallel target
(:mod:`longspec.model.parallel`) each rank's cache holds only its ``Hkv / K`` KV heads, the ones its attention
computes, and says so in :attr:`StaticKVCache.tp`.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import Tensor
from transformers import AttentionInterface

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)

from .geometry import attention_modules, head_dim, num_kv_heads  # noqa: F401  (also imported from here)
from .invariant import chain_ancestors, tree_ancestors
from .parallel import check_head_split

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from longspec.model.parallel import TensorParallel

ATTN_IMPLEMENTATION = "longspec"

# Architectures whose attention goes through ALL_ATTENTION_FUNCTIONS with post-RoPE q/k/v and a ``layer_idx``, and
# whose logits are ``lm_head(final hidden)``. Others may work but are refused rather than risk silent errors.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Attribute under which each attention module holds its layer's cache view during a forward (see _bind).
_BOUND_KV = "longspec_kv"

# RoPE variants whose frequencies depend on the largest position in the current forward: a tree forward reaches
# further than a one-token step, so the logits would differ from plain decoding.
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


class Phase(enum.Enum):
    """What an attention call does with its new tokens (see the module docstring)."""

    EXTEND = enum.auto()
    TREE = enum.auto()


class StaticKVCache:
    """A preallocated KV cache for every layer in one allocation, with committed lengths per row.

    Attributes:
        kv: contiguous ``[L, 2, B, N, Hkv, D]``; ``kv[l, 0]`` / ``kv[l, 1]`` are layer l's keys (post-RoPE) / values.
        seqlens: int32 ``[B]`` committed lengths; rows ``[0, seqlens[b])`` of every layer are valid.
        tp: for a tensor-parallel target, which KV heads this rank's cache holds (``Hkv`` is then the local
            count, ``tp.local_kv_heads``); None for a whole model.

    ``commit_kv_`` takes :meth:`planes` (``kv.view(2 * L, B, N, Hkv, D)``).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: Optional["TensorParallel"] = None,
    ) -> None:
        if min(num_layers, batch_size, max_len, num_kv_heads, head_dim) < 1:
            raise ValueError(
                "StaticKVCache sizes must be positive, got "
                f"num_layers={num_layers}, batch_size={batch_size}, max_len={max_len}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        shape = (num_layers, 2, batch_size, max_len, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        if tp is not None and tp.local_kv_heads != num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must be this rank's share of the KV heads, "
                             f"{tp.num_kv_heads} / {tp.world} = {tp.local_kv_heads}")
        self.tp = tp

    @classmethod
    def from_config(
        cls, config: "PretrainedConfig", batch_size: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
        tp: Optional["TensorParallel"] = None,
    ) -> "StaticKVCache":
        """A cache sized for a transformers decoder config (``num_hidden_layers``, KV heads, head dim); with ``tp``
        (:func:`longspec.model.parallel.tensor_parallel`) it holds this rank's KV heads only."""
        heads = num_kv_heads(config)
        if tp is not None:
            check_head_split(config, tp.world)
            heads //= tp.world
        return cls(config.num_hidden_layers, batch_size, max_len, heads, head_dim(config), dtype, device, tp)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def batch_size(self) -> int:
        return self.kv.shape[2]

    @property
    def max_len(self) -> int:
        return self.kv.shape[3]

    def key(self, layer: int) -> Tensor:
        """``[B, N, Hkv, D]`` view of layer ``layer``'s keys."""
        return self.kv[layer, 0]

    def value(self, layer: int) -> Tensor:
        """``[B, N, Hkv, D]`` view of layer ``layer``'s values."""
        return self.kv[layer, 1]

    def planes(self) -> Tensor:
        """``[2L, B, N, Hkv, D]`` view (K and V planes of every layer), the layout ``commit_kv_`` expects."""
        L, _, B, N, H, D = self.kv.shape
        return self.kv.view(2 * L, B, N, H, D)

    def write(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Scatter new K/V ``[B, S, Hkv, D]`` of layer ``layer`` to cache rows ``rows`` (int64 ``[B, S]``)."""
        _write_rows(self.kv[layer], _batch_index(rows), rows, k, v)


def _batch_index(rows: Tensor) -> Tensor:
    """int64 ``[B, S]``: the batch row of every entry of ``rows``, for advanced-index scatters."""
    return torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)


def _write_rows(layer_kv: Tensor, batch: Tensor, rows: Tensor, k: Tensor, v: Tensor) -> None:
    """K/V ``[B, S, Hkv, D]`` into rows ``rows`` of one layer's ``[2, B, N, Hkv, D]`` cache.

    One ``index_put_`` on the layer's tensor itself (K and V stacked), not one per K/V view: torch.compile then
    writes in place, where a write through a ``select`` view of a graph input is functionalised into a copy of the
    whole layer cache.
    """
    plane = torch.arange(2, device=rows.device)[:, None, None]
    layer_kv.index_put_((plane, batch[None], rows[None]), torch.stack([k, v]))


@dataclass
class AttentionStep:
    """One forward's instructions to :func:`longspec_attention`, shared by every layer.

    phase:     :class:`Phase`.
    cache:     the :class:`StaticKVCache` the new K/V go to (and the committed rows come from).
    rows:      int64 ``[B, S]`` cache rows receiving the new tokens' K/V (``seqlens[:, None] + arange(S)``).
    batch:     int64 ``[B, S]`` the batch row of each entry of ``rows`` (the scatter's other index).
    kv_lens:   int32 ``[B, S]`` (EXTEND) rows ``[0, kv_lens[b, i])`` visible to query i.
    tree_mask: bool ``[B, S, S]`` (TREE) tree query i sees tree key j.
    seqlens:   int32 ``[B]`` (TREE, and EXTEND when invariant) committed rows every query sees, usually
               ``cache.seqlens``.
    ancestors: int32 ``[B, S, S]`` (invariant numerics) each new token's ancestors among the new tokens, in depth
               order, with ``depths`` int32 ``[B, S]``: attention is then ``invariant_attn``
               (:func:`longspec.model.invariant.tree_ancestors`).
    checked:   whether a layer of this forward already ran the attention op with its argument checks; the other
               layers then call its unchecked twin (every layer passes the same shapes, dtypes and devices).
    """

    phase: Phase
    cache: StaticKVCache
    rows: Tensor
    batch: Tensor
    kv_lens: Optional[Tensor] = None
    tree_mask: Optional[Tensor] = None
    seqlens: Optional[Tensor] = None
    ancestors: Optional[Tensor] = None
    depths: Optional[Tensor] = None
    checked: bool = False

    @classmethod
    def extend(cls, cache: StaticKVCache, num_new: int, invariant: bool = False) -> "AttentionStep":
        rows = cache.seqlens.to(torch.int64)[:, None] + torch.arange(num_new, device=cache.seqlens.device)
        step = cls(Phase.EXTEND, cache, rows, _batch_index(rows), kv_lens=(rows + 1).to(torch.int32))
        if invariant:
            step.seqlens = cache.seqlens
            step.ancestors, step.depths = chain_ancestors(rows.shape[0], num_new, rows.device)
        return step

    @classmethod
    def tree(cls, cache: StaticKVCache, tree_mask: Tensor, seqlens: Optional[Tensor] = None,
             invariant: bool = False) -> "AttentionStep":
        seqlens = cache.seqlens if seqlens is None else seqlens
        rows = seqlens.to(torch.int64)[:, None] + torch.arange(tree_mask.shape[1], device=tree_mask.device)
        step = cls(Phase.TREE, cache, rows, _batch_index(rows), tree_mask=tree_mask, seqlens=seqlens)
        if invariant:
            step.ancestors, step.depths = tree_ancestors(tree_mask)
        return step


def longspec_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    longspec_step: Optional[AttentionStep] = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The ``"longspec"`` attention implementation: q ``[B, Hq, S, D]``, k/v ``[B, Hkv, S, D]`` after RoPE.

    Returns ``(out [B, S, Hq, D], None)``. ``attention_mask`` is ignored (none is built for this implementation);
    the step carries all visibility. Sliding windows are not applied: generate refuses sequences longer than the
    window (see :func:`check_generation_length`), where a window changes nothing.

    The layer's cache is the ``[2, B, N, Hkv, D]`` view that :func:`_run` binds to ``module`` as
    ``longspec_kv`` before each forward, not ``cache.kv[module.layer_idx]``: an integer read off the module would
    specialise a ``torch.compile``d layer to its index, and one compiled layer could not serve them all.
    """
    step = longspec_step
    layer_kv = getattr(module, _BOUND_KV, None)
    if step is None or layer_kv is None:
        raise RuntimeError(
            "the 'longspec' attention implementation needs a longspec_step; run the model through "
            "longspec.SpeculativeDecoder (or longspec.model.target.forward_extend / forward_tree)"
        )
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # flash layout views, no copies
    _write_rows(layer_kv, step.batch, step.rows, k, v)
    # The raw ops: no host syncs in the decode loop (lengths come from the engine, see longspec_ops.ops). The first
    # layer's call checks the arguments; every later layer repeats their metadata, so it skips the checks. Traced
    # by torch.compile, the checked op's fake checks at trace time and costs nothing at run time.
    checked = step.checked and not torch.compiler.is_compiling()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if step.ancestors is not None:
        out, _ = torch.ops.longspec.invariant_attn(q, layer_kv[0], layer_kv[1], step.seqlens, step.ancestors,
                                                   step.depths, scale)
    elif step.phase is Phase.EXTEND:
        op = torch.ops.longspec._prefix_attn_kernel if checked else torch.ops.longspec.prefix_attn
        out, _ = op(q, layer_kv[0], layer_kv[1], step.kv_lens, scale)
    else:
        op = torch.ops.longspec._hybrid_tree_attn_kernel if checked else torch.ops.longspec.hybrid_tree_attn
        out, _ = op(q, layer_kv[0], layer_kv[1], step.seqlens, k, v, step.tree_mask, scale)
    if not torch.compiler.is_compiling():
        step.checked = True
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, longspec_attention)


def check_supported(model: "PreTrainedModel") -> None:
    """Raise ``ValueError`` naming the architecture unless ``model`` is a supported decoder-only causal LM."""
    config = model.config
    name = type(model).__name__
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"longspec: unsupported target architecture {name} (model_type={model_type!r}); "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not model._can_set_attn_implementation() or model.get_output_embeddings() is None:
        raise ValueError(f"longspec: {name} does not route attention through transformers' AttentionInterface")
    layers = getattr(model.base_model, "layers", None)
    if layers is None or any(getattr(getattr(layer, "self_attn", None), "layer_idx", None) != i
                             for i, layer in enumerate(layers)):
        raise ValueError(f"longspec: {name} does not hold its decoder layers as base_model.layers[i].self_attn "
                         "with layer_idx == i")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = str(rope.get("rope_type", "default")) if isinstance(rope, dict) else "default"
    if any(kind in rope_type for kind in _POSITION_DEPENDENT_ROPE):
        raise ValueError(
            f"longspec: {name} uses rope_type={rope_type!r}, whose frequencies depend on the longest position in a "
            "forward; speculative verification would not reproduce plain decoding"
        )


def sliding_window(config: "PretrainedConfig") -> Optional[int]:
    """The smallest attention window any layer uses, or None when every layer attends to the full context."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_generation_length(model: "PreTrainedModel", total_len: int) -> None:
    """Refuse a prompt + generation of ``total_len`` tokens the model cannot handle exactly.

    Raises ``ValueError`` when it exceeds ``max_position_embeddings`` or a sliding attention window (the engine's
    kernels attend to full context; within the window the two are identical).
    """
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and total_len > limit:
        raise ValueError(
            f"prompt + max_new_tokens = {total_len} tokens exceeds the model's max_position_embeddings ({limit})"
        )
    window = sliding_window(config)
    if window is not None and total_len > window:
        raise ValueError(
            f"prompt + max_new_tokens = {total_len} tokens exceeds the model's sliding_window ({window}); "
            "longspec attends to the full context and does not implement sliding-window attention"
        )


@contextlib.contextmanager
def use_longspec_attention(model: "PreTrainedModel") -> Iterator[None]:
    """Route ``model``'s attention through :func:`longspec_attention` inside the block, then restore it (and drop
    the cache views the forwards bound to its attention modules)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _unbind(model)


def _bind(model: "PreTrainedModel", cache: StaticKVCache) -> None:
    """Give every attention module its layer's ``[2, B, N, Hkv, D]`` view of ``cache`` (see longspec_attention)."""
    for i, attn in enumerate(attention_modules(model)):
        view = cache.kv[i]
        torch._dynamo.maybe_mark_dynamic(view, 2)  # the cache length: one compile serves every cache size
        setattr(attn, _BOUND_KV, view)


def _unbind(model: "PreTrainedModel") -> None:
    for attn in attention_modules(model):
        attn.__dict__.pop(_BOUND_KV, None)


def _run(model: "PreTrainedModel", input_ids: Tensor, position_ids: Tensor, step: AttentionStep) -> Tensor:
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError("run the target inside longspec.model.target.use_longspec_attention(model)")
    _bind(model, step.cache)
    out = model.base_model(
        input_ids=input_ids, position_ids=position_ids, use_cache=False, longspec_step=step
    )
    return out.last_hidden_state


def forward_extend(model: "PreTrainedModel", cache: StaticKVCache, input_ids: Tensor,
                   invariant: bool = False) -> Tensor:
    """Append ``input_ids`` (int64 ``[B, S]``) after each row's committed tokens; return hidden ``[B, S, H]``.

    Token i of row b is at position and cache row ``cache.seqlens[b] + i``. ``cache.seqlens`` is not advanced.
    ``invariant``: attention through ``invariant_attn`` (run the forward inside
    :meth:`longspec.model.invariant.InvariantTarget.active` for the linears and norms).
    """
    step = AttentionStep.extend(cache, input_ids.shape[1], invariant)
    return _run(model, input_ids, step.rows, step)


def forward_tree(
    model: "PreTrainedModel",
    cache: StaticKVCache,
    input_ids: Tensor,
    position_ids: Tensor,
    tree_mask: Tensor,
    seqlens: Optional[Tensor] = None,
    invariant: bool = False,
) -> Tensor:
    """Run T tree tokens (int64 ``[B, T]``) at RoPE positions ``position_ids`` (int64 ``[B, T]``) under
    ``tree_mask`` (bool ``[B, T, T]``) over the committed rows ``[0, seqlens[b])`` (default ``cache.seqlens``);
    return hidden ``[B, T, H]``.

    Their K/V land in scratch rows ``seqlens[b] + [0, T)``; ``cache.seqlens`` is not advanced. ``invariant``:
    attention through ``invariant_attn``, which needs an ancestor-or-self ``tree_mask`` whose parents precede
    their children (every tree the decoder verifies); each node then sees exactly the keys plain decoding sees at
    it once its ancestors are committed.
    """
    step = AttentionStep.tree(cache, tree_mask, seqlens, invariant)
    return _run(model, input_ids, position_ids, step)


class CompiledTarget:
    """``torch.compile`` of a target's repeated modules, switched on for the forwards inside :meth:`active`.

    Regional compilation: each decoder layer, the final norm and the rotary embedding are compiled on their own
    (``fullgraph``), so Inductor fuses each layer's elementwise work (norms with their residual adds, RoPE with
    the cache write, SiLU * up) into a few kernels around the matmuls and the longspec attention ops, which stay
    opaque custom ops. Every layer runs the same compiled code: its cache view is a tensor attribute (see
    :func:`longspec_attention`), so one compile per input shape serves all layers, and the first forward of a shape
    costs a few seconds instead of a whole-model compile. Shapes that change between calls (the verify width, the
    cache length) are recompiled once as dynamic (torch.compile's automatic dynamic shapes).

    The modules are compiled only inside ``active()`` (``nn.Module.compile`` sets the module's compiled call,
    which is unset again on exit), so the model behaves as before everywhere else; the compiled code stays cached
    by torch.compile for the next entry. The float32 CPU tests check that the outputs of decoding do not change.
    """

    # One code object serves every decoder layer of every model in the process (transformers' layer __call__), and
    # each (model, shape, dtype) is one of its cache entries: torch.compile's default limit of 8 is too few.
    RECOMPILE_LIMIT = 64

    def __init__(self, model: "PreTrainedModel") -> None:
        base = model.base_model
        self.modules = [*base.layers, base.norm, base.rotary_emb]
        # What nn.Module.compile() installs, made once: a torch.compile wrapper made anew on every entry would not
        # find the code the previous one compiled.
        self._calls = [torch.compile(m._call_impl, fullgraph=True) for m in self.modules]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with torch._dynamo.config.patch(recompile_limit=self.RECOMPILE_LIMIT):
            for m, call in zip(self.modules, self._calls):
                m._compiled_call_impl = call  # as nn.Module.compile() does
            try:
                yield
            finally:
                for m in self.modules:
                    m._compiled_call_impl = None  # what nn.Module.__init__ sets: plain eager calls again


def lm_logits(model: "PreTrainedModel", hidden: Tensor) -> Tensor:
    """The target's logits for final hidden states ``[..., H]``: ``[..., V]`` in float32."""
    return model.get_output_embeddings()(hidden).float()
