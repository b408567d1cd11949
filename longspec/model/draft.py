"""The LongSpec draft model: one decoder block that reads the target's last-layer KV cache.

LongSpec (arXiv 2502.17421), as the authors' ``LlamaGlideDecoderLayer`` computes it::

    x      = target.embed_tokens(ids)                      borrowed, not stored
    h1     = x  + SA(N1(x))       causal self-attention, window W = 512: a query at position t sees keys t-W..t
    h2     = h1 + CA(N2(h1))      queries RoPE'd at their own positions by the target's rotary module; keys and
                                  values are the target's last-layer cache (keys already post-RoPE), rows < t
    out    = h2 + MLP(N3(h2))     SwiGLU with the target's activation
    logits = target.lm_head(out)  no final norm: the published weights were trained without one

Six submodules carry the published names (20 tensors): ``input_layernorm``, ``self_attn``,
``post_self_attention_layernorm``, ``cross_attn``, ``post_cross_attention_layernorm``, ``mlp``. q/k/v projections
have biases, o_proj has none. ``cross_attn.k_proj``/``v_proj`` exist only so that published checkpoints load: the
keys and values of the cross-attention are the target's, so they are never computed.

``config.extra_cross_blocks`` (0 in the method and every published draft) appends that many
:class:`~longspec.model.draft_blocks.CrossBlock` (cross-attention + MLP, no self-attention) after the block, under
``extra_blocks.{i}.``: not the paper's draft, an option for drafts that a wider MLP did not bring closer to their
target (:func:`~longspec.model.draft_grow.add_cross_blocks` grows a trained draft with them, as the identity).

The embeddings, rotary embedding and LM head belong to the target. The draft holds the target through a plain
reference (not a submodule), so they appear in neither ``parameters()`` nor the state dict.

Decoding does not call :meth:`LongSpecDraft.forward`: :class:`longspec.decode.longspec_drafter.LongSpecDrafter`
composes the phase methods below (``embed``, ``rope``, ``self_qkv``, ``finish``, ``logits``) around its own
constant-size caches. ``forward`` runs a whole sequence at once (training, tests).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import longspec_ops  # noqa: F401  (registers torch.ops.longspec)
from longspec.model.draft_attention import (
    shifted_cross_attention,
    windowed_self_attention,
)
from longspec.model.draft_blocks import CrossBlock, LongSpecAttention, apply_rope
from longspec.model.draft_config import LongSpecDraftConfig, check_target_compatible
from longspec.model.draft_files import (
    _is_dtensor,
    count_tokens,
    frequent_tokens,
    load_draft,
    load_draft_vocab,
    save_draft_vocab,
)
from longspec.model.packing import (Packed, check_weight_dtype, drafting_weights, fused_linear as _fused,
                                    pack_projections, packed_or_none, quantize_linears)
from longspec.model.parallel import TensorParallel, gather_heads

# The 20 tensors of a published checkpoint; every one is a parameter of LongSpecDraft under the same name.
PUBLISHED_TENSOR_NAMES: tuple[str, ...] = tuple(
    [f"{attn}.{p}_proj.{kind}" for attn in ("self_attn", "cross_attn") for p in "qkv" for kind in ("weight", "bias")]
    + ["self_attn.o_proj.weight", "cross_attn.o_proj.weight"]
    + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    + [f"{n}.weight" for n in ("input_layernorm", "post_self_attention_layernorm", "post_cross_attention_layernorm")]
)

@dataclass(frozen=True)
class _Borrowed:
    """The target's modules the draft uses. A plain object, so nn.Module never registers, saves or moves them."""

    target: nn.Module
    embed_tokens: nn.Module
    rotary_emb: nn.Module
    lm_head: nn.Module


def _borrow(target: nn.Module) -> _Borrowed:
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    rotary = getattr(getattr(target, "base_model", target), "rotary_emb", None)
    if embed is None or head is None or rotary is None:
        raise ValueError(
            f"{type(target).__name__} must expose input embeddings, an LM head and a `rotary_emb` module on its base "
            "model (as transformers' Llama/Qwen2/Mistral causal LMs do)"
        )
    return _Borrowed(target, embed, rotary, head)


class LongSpecDraft(PreTrainedModel):
    """The LongSpec draft block (module docstring); build it with :meth:`from_target` or :meth:`from_pretrained`.

    Example::

        >>> target = AutoModelForCausalLM.from_pretrained("gradientai/Llama-3-8B-Instruct-262k", dtype=torch.float16)
        >>> draft = LongSpecDraft.from_pretrained("sail/longspec-Llama-3-8B-Instruct-262k", target=target)
        >>> decoder = SpeculativeDecoder(target, LongSpecDrafter(draft), tree_shape=(4, 16, 16, 16, 16))
    """

    config_class = LongSpecDraftConfig
    config: LongSpecDraftConfig
    base_model_prefix = "model"  # the prefix a published checkpoint may carry ("model.self_attn....")
    _no_split_modules = ["LongSpecAttention", "LlamaMLP", "CrossBlock"]

    def __init__(self, config: LongSpecDraftConfig) -> None:
        super().__init__(config)
        # RMSNorm and the gated MLP are transformers' own Llama modules (the authors' block uses the same math)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LongSpecAttention(config)
        self.post_self_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn = LongSpecAttention(config)
        self.post_cross_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        # config.extra_cross_blocks cross-attention + MLP blocks after the block (none in the method's draft)
        self.extra_blocks = nn.ModuleList(CrossBlock(config) for _ in range(config.extra_cross_blocks))
        self._borrowed: Optional[_Borrowed] = None
        # The reduced drafting vocabulary (see set_draft_vocab): target token ids, sorted; None = the full head.
        # Not in the state dict (published checkpoints have none): saved as draft_vocab.json beside the weights.
        self.register_buffer("draft_vocab", None, persistent=False)
        self._draft_head: Optional[Tensor] = None  # lm_head rows of draft_vocab, gathered when either is set
        self._packed: Optional[Packed] = None  # q/k/v and gate/up packed for drafting (pack_for_drafting)
        self.post_init()

    # --- the target ------------------------------------------------------------------------------------------------

    @property
    def target(self) -> nn.Module:
        """The target model whose embeddings, rotary embedding, LM head and last-layer cache the draft uses."""
        return self._require_target().target

    def bind_target(self, target: nn.Module) -> "LongSpecDraft":
        """Borrow ``target``'s embeddings, rotary embedding and LM head (no copies); checks the geometry first."""
        check_target_compatible(self.config, target)
        self._borrowed = _borrow(target)
        self._gather_draft_head()
        return self

    def pack_for_drafting(self, weight_dtype: Optional[torch.dtype] = None) -> "LongSpecDraft":
        """Lay the self-attention's q/k/v and the MLP's gate/up weights out as one tensor each (the parameters
        become views of them: same values, same state dict, no second copy), so that drafting (gradients off) runs
        one GEMM per group (:mod:`longspec.model.packing`). Idempotent; packs again after anything gave the
        parameters new storage (``.to()``, an assigning load). :class:`~longspec.LongSpecDrafter` calls it at
        prefill. ``weight_dtype=torch.float8_e4m3fn``: every linear of a level and the drafting head rows are read
        as float8 copies with per-row scales, half the bytes; the trees change slightly, the output does not. The
        K/V of committed tokens (the drafter's prefill and re-feed, ``need_q=False``) keep the 16-bit q/k/v, so the
        window is the same whatever the drafting weights."""
        fp8 = check_weight_dtype(weight_dtype, self.dtype, "LongSpecDraft.pack_for_drafting")
        packed = packed_or_none(self._packed)
        if packed is None:
            packed = pack_projections(self.self_attn, self.mlp, [b.mlp for b in self.extra_blocks])
        if fp8:
            head = self._draft_head if self._draft_head is not None else self._require_target().lm_head.weight
            sources = drafting_weights(self, packed, head)
            if packed.fp8 is not None and packed.fp8.covers(sources):
                packed.fp8.refresh()  # in place: graphs captured on the copies stay valid
            else:
                packed = replace(packed, fp8=quantize_linears(sources))
        elif packed.fp8 is not None:
            packed = replace(packed, fp8=None)
        self._packed = packed
        return self

    def _require_target(self) -> _Borrowed:
        if self._borrowed is None:
            raise RuntimeError("LongSpecDraft has no target: build it with from_target/from_pretrained or bind_target")
        return self._borrowed

    @property
    def vocab_size(self) -> int:
        """Rows of the target's LM head: the vocabulary the draft proposes from."""
        return self._require_target().lm_head.weight.shape[0]

    # --- phase methods (shapes: B batch, S tokens, H hidden, Hq/Hkv heads, D head_dim) ------------------------------

    def embed(self, ids: Tensor) -> Tensor:
        """ids int64 ``[B, S]`` -> x ``[B, S, H]`` through the target's embeddings, in the draft's dtype."""
        return self._require_target().embed_tokens(ids).to(self.dtype)

    def rope(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin ``[B, S, D]`` at absolute ``positions`` (int64 ``[B, S]``) from the target's rotary module.

        The target's module carries its RoPE scaling (linear, dynamic, llama3, yarn ...), so draft and target
        rotate identically.
        """
        cos, sin = self._require_target().rotary_emb(x, positions)
        if cos.shape[-1] != self.config.head_dim:
            raise ValueError(
                f"the target's rotary embedding has dim {cos.shape[-1]}, the draft's head_dim is "
                f"{self.config.head_dim}; "
                "partial rotary embeddings are not supported"
            )
        return cos, sin

    def self_qkv(
        self, x: Tensor, cos: Tensor, sin: Tensor, need_q: bool = True
    ) -> tuple[Optional[Tensor], Tensor, Tensor]:
        """Self-attention projections of N1(x): q ``[B, S, Hq, D]`` (None unless need_q), k, v ``[B, S, Hkv, D]``.

        q and k are rotated (post-RoPE), so cached keys never need their positions again.
        """
        B, S, _ = x.shape
        attn, D = self.self_attn, self.config.head_dim
        packed = self._drafting()
        if packed is not None:  # one launch for N1 and q, k and v (k and v only without q)
            first = 0 if need_q else attn.num_heads * D
            bias = packed.qkv_bias[first:] if packed.qkv_bias is not None else None
            # committed tokens' K/V (need_q False: prefill, re-feed) keep the 16-bit weights, so the ring does not
            # depend on the drafting weights (and prefill's W rows are more than fp8's kernel takes)
            weight = self._packed.weight("qkv", packed.qkv_weight) if need_q else (packed.qkv_weight[first:], None)
            qkv = _fused(x, weight, bias, norm=self.input_layernorm).view(B, S, -1, D)
            q, k, v = qkv.split([attn.num_heads if need_q else 0, attn.num_kv_heads, attn.num_kv_heads], dim=2)
        else:
            n = self.input_layernorm(x)
            q = attn.q_proj(n).view(B, S, attn.num_heads, D) if need_q else None
            k = attn.k_proj(n).view(B, S, attn.num_kv_heads, D)
            v = attn.v_proj(n).view(B, S, attn.num_kv_heads, D)
        return (apply_rope(q, cos, sin) if need_q else None), apply_rope(k, cos, sin), v

    def finish(
        self,
        x: Tensor,
        self_out: Tensor,
        cos: Tensor,
        sin: Tensor,
        target_key: Tensor,
        target_value: Tensor,
        q_pos: Optional[Tensor],
        target_lens: Tensor,
        tp: Optional["TensorParallel"] = None,
    ) -> Tensor:
        """The rest of the block after self-attention: residual, cross-attention, MLP. Returns out ``[B, S, H]``.

        Args:
            x: ``[B, S, H]`` block input; self_out: ``[B, S, Hq, D]`` self-attention output (before o_proj).
            cos, sin: ``[B, S, D]`` RoPE at the tokens' positions (the cross queries are rotated there too).
            target_key, target_value: ``[B, N, Hkv, D]`` the target's last-layer cache (keys post-RoPE).
            q_pos: int32 ``[B, S]`` and target_lens: int32 ``[B]``: query i sees target rows
                ``[0, min(q_pos[b, i], target_lens[b]))`` (see :func:`longspec_ops.draft_cross_attn`); with
                ``q_pos=None`` every query sees rows ``[0, target_lens[b])`` (tree nodes: the rows before the root),
                one length per batch row (no per-query length kernel; the sm_90 kernel takes such calls).
            tp: the target is tensor-parallel (:class:`~longspec.model.parallel.TensorParallel`) and the cache
                holds only this rank's ``Hkv / K`` KV heads: the cross-attention runs the query heads that read
                them and the ranks gather the outputs (``[B, S, Hq, D]``, a few hundred KB per level), so no rank
                ever reads or moves another rank's cache rows. The rest of the draft is replicated: every rank
                computes the same tree from the same gathered values.
        """
        h = self.after_self_attention(x, self_out)
        for part in self._cross_parts():
            h = self.after_cross_attention(h, self.cross_attend(self.cross_query(h, cos, sin, part), target_key,
                                                                target_value, q_pos, target_lens, tp), part)
        return h

    def _cross_parts(self) -> tuple[Optional[int], ...]:
        """The cross-attention + MLP parts in order: the block's (None), then each extra block's index."""
        return (None, *range(len(self.extra_blocks)))

    def cross_attend(self, q: Tensor, target_key: Tensor, target_value: Tensor, q_pos: Optional[Tensor],
                     target_lens: Tensor, tp: Optional["TensorParallel"] = None) -> Tensor:
        """Cross-attention of rotated queries ``[B, S, Hq, D]`` into the target's cache while decoding (arguments as
        :meth:`finish`'s): ``[B, S, Hq, D]``."""
        scale = self.config.head_dim ** -0.5
        local_q = q if tp is None else tp.local_query(q)
        if q_pos is None:
            local, _ = torch.ops.longspec.prefix_attn(local_q, target_key, target_value, target_lens, scale)
        else:
            local, _ = torch.ops.longspec.draft_cross_attn(local_q, target_key, target_value, q_pos, target_lens,
                                                            scale)
        return local if tp is None else gather_heads(local, tp)

    def after_self_attention(self, x: Tensor, self_out: Tensor) -> Tensor:
        """h1 = x + o_proj(self_out): x ``[B, S, H]``, self_out ``[B, S, Hq, D]``."""
        B, S, _ = x.shape
        o_proj = self.self_attn.o_proj
        packed = self._drafting()
        if packed is not None:
            return _fused(self_out.reshape(B, S, -1), packed.weight("self_o", o_proj.weight), o_proj.bias, residual=x)
        return x + o_proj(self_out.reshape(B, S, -1))

    def _cross_part(self, part: Optional[int]) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module, str]:
        """(cross_attn, its query norm, the MLP's norm, the MLP, the float8 weight names' prefix) of the block's
        cross-attention + MLP (``part`` None) or of extra block ``part``."""
        if part is None:
            return (self.cross_attn, self.post_self_attention_layernorm, self.post_cross_attention_layernorm,
                    self.mlp, "")
        blk = self.extra_blocks[part]
        return blk.cross_attn, blk.cross_norm, blk.mlp_norm, blk.mlp, f"x{part}."

    def cross_query(self, h1: Tensor, cos: Tensor, sin: Tensor, part: Optional[int] = None) -> Tensor:
        """Cross-attention queries ``[B, S, Hq, D]``, rotated at the tokens' own positions (``part``: None for the
        block's cross-attention, i for extra block i's).

        ``cross_attn.k_proj`` / ``v_proj`` are dead weights: keys and values are the target's own cache rows.
        """
        B, S, _ = h1.shape
        ca, norm, _, _, prefix = self._cross_part(part)
        if self._drafting() is not None:
            q = _fused(h1, self._packed.weight(prefix + "cross_q", ca.q_proj.weight), ca.q_proj.bias, norm=norm)
        else:
            q = ca.q_proj(norm(h1))
        return apply_rope(q.view(B, S, ca.num_heads, ca.head_dim), cos, sin)

    def after_cross_attention(self, h1: Tensor, cross: Tensor, part: Optional[int] = None) -> Tensor:
        """out = h2 + MLP(N3(h2)) with h2 = h1 + o_proj(cross); cross ``[B, S, Hq, D]`` (``part`` as
        :meth:`cross_query`'s).

        Drafting runs it as three ``longspec::fused_linear`` launches: o_proj with the residual, N3 + gate/up +
        SwiGLU (the act in the launch when it is SiLU), down_proj with the residual."""
        B, S, _ = h1.shape
        ca, _, norm, mlp, prefix = self._cross_part(part)
        o_proj = ca.o_proj
        packed = self._drafting()
        if packed is None:
            h2 = h1 + o_proj(cross.reshape(B, S, -1))
            return h2 + mlp(norm(h2))
        h2 = _fused(cross.reshape(B, S, -1), packed.weight(prefix + "cross_o", o_proj.weight), o_proj.bias,
                    residual=h1)
        gate_up_weight, gate_up_bias = packed.gate_up(part)
        gate_up = packed.weight(prefix + "gate_up", gate_up_weight)
        if self.config.hidden_act in ("silu", "swish"):  # transformers' names of one function
            act = _fused(h2, gate_up, gate_up_bias, norm=norm, swiglu=True)
        else:
            gate, up = _fused(h2, gate_up, gate_up_bias, norm=norm).chunk(2, dim=-1)
            act = mlp.act_fn(gate) * up
        return _fused(act, packed.weight(prefix + "down", mlp.down_proj.weight), mlp.down_proj.bias, residual=h2)

    def _drafting(self) -> Optional[Packed]:
        """The packed projections while drafting (gradients off, :meth:`pack_for_drafting` done), else None:
        drafting runs the block's linears as ``longspec::fused_linear`` (norms, SwiGLU and residual adds folded
        in on CUDA; on the CPU the same composition of PyTorch ops as training's path, bit for bit)."""
        return self._packed if not torch.is_grad_enabled() else None

    def logits(self, out: Tensor) -> Tensor:
        """out ``[B, S, H]`` -> logits ``[B, S, V]`` through the target's LM head, with no final norm."""
        head = self._require_target().lm_head
        if self._drafting() is not None and not _is_dtensor(head.weight):  # a tensor-parallel head: its own path
            return _fused(out.to(head.weight.dtype), self._packed.weight("head", head.weight), head.bias)
        return head(out.to(head.weight.dtype))

    # --- the reduced drafting vocabulary ---------------------------------------------------------------------------

    def set_draft_vocab(self, token_ids: Optional[Tensor]) -> "LongSpecDraft":
        """Draft from ``token_ids`` only (target ids, e.g. :func:`frequent_tokens` of the training data), or from
        the whole vocabulary again with None.

        Drafting then scores ``len(token_ids)`` rows of the target's LM head instead of all of them: at Llama-3's
        128,256-token vocabulary the full head is a 1 GB read per draft level. Verification is unchanged, so the
        output stays exactly the target's; tokens outside the set are never proposed, which costs acceptance only
        where the target wants them. Training always uses the full head.
        """
        if token_ids is None:
            self.draft_vocab = None
            self._gather_draft_head()
            return self
        V = self.vocab_size
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64) or ids.is_floating_point():
            raise ValueError(f"token_ids must be a non-empty 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
        ids = torch.unique(ids.to(torch.int64).cpu())  # sorted
        if int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ValueError(f"token_ids must lie in [0, {V}) (the target's vocabulary), got [{int(ids[0])}, "
                             f"{int(ids[-1])}]")
        self.draft_vocab = ids.to(self._require_target().lm_head.weight.device)
        self._gather_draft_head()
        return self

    def _gather_draft_head(self) -> None:
        """The LM head rows of ``draft_vocab``, gathered once (here, not lazily inside a compiled or captured
        ``propose``, where building it would change what the next call sees)."""
        if self._packed is not None and self._packed.fp8 is not None:  # its head copy is the old head's
            self._packed = replace(self._packed, fp8=None)
        if self.draft_vocab is None:
            self._draft_head = None
            return
        head = self._require_target().lm_head.weight.detach()
        if _is_dtensor(head):  # a tensor-parallel target's head holds a slice of the vocabulary per rank
            head = head.full_tensor()  # a collective: every rank binds its draft and sets its vocabulary alike
        self._draft_head = head.index_select(0, self.draft_vocab.to(head.device))

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the draft proposes from: ``len(draft_vocab)``, or the whole vocabulary."""
        return self.vocab_size if self.draft_vocab is None else self.draft_vocab.numel()

    def draft_logits(self, out: Tensor) -> Tensor:
        """out ``[B, S, H]`` -> logits ``[B, S, draft_vocab_size]`` over the drafting vocabulary (column j is
        target token ``draft_vocab[j]``; the full head's logits when none is set)."""
        if self.draft_vocab is None:
            return self.logits(out)
        if self._drafting() is not None:
            return _fused(out.to(self._draft_head.dtype), self._packed.weight("head", self._draft_head), None)
        return torch.nn.functional.linear(out.to(self._draft_head.dtype), self._draft_head)

    def target_token_ids(self, draft_ids: Tensor) -> Tensor:
        """Columns of :meth:`draft_logits` (int64, any shape) -> the target's token ids."""
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, plus ``draft_vocab.json`` when a drafting vocabulary is set."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.draft_vocab is not None:
            save_draft_vocab(save_directory, self.draft_vocab)

    def forward(
        self,
        input_ids: Tensor,
        target_key: Tensor,
        target_value: Tensor,
        position_ids: Optional[Tensor] = None,
        delta: int = 1,
    ) -> Tensor:
        """Run the block on whole sequences with differentiable attention (training; decoding uses
        ``LongSpecDrafter``). Returns the block output ``[B, S, H]``; :meth:`logits` maps it to the vocabulary.

        Args:
            input_ids: int64 ``[B, S]``; position_ids: int64 ``[B, S]`` RoPE positions (default ``arange(S)``),
                non-decreasing (anchor-offset positions jump once).
            target_key, target_value: ``[B, N, Hkv, D]`` the target's last-layer K/V of the same tokens (token j at
                row j), N >= S - delta.
            delta: flash noisy training: the token at index t sees target rows ``<= t - delta`` (1 at inference for
                a re-fed token; a depth-d tree node reads rows d + 1 back).

        Self-attention is causal over the sequence with the window taken on positions: token i sees token j <= i
        iff ``position_ids[i] - position_ids[j] <= window``, as at inference, where the window holds the tokens at
        the W positions before the query. Cross-attention is one causal flash-style call on shifted inputs (queries
        from index delta on, target rows up to S - delta): no dense mask.
        """
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if delta < 1:
            raise ValueError(f"delta must be >= 1, got {delta}")
        if target_key.shape[1] < S - delta:
            raise ValueError(f"target_key holds {target_key.shape[1]} rows; {S} tokens at delta {delta} need "
                             f"{S - delta}")
        x = self.embed(input_ids)
        cos, sin = self.rope(x, position_ids)
        q, k, v = self.self_qkv(x, cos, sin)
        h = self.after_self_attention(x, windowed_self_attention(q, k, v, position_ids, self.config.window))
        for part in self._cross_parts():
            cross = shifted_cross_attention(self.cross_query(h, cos, sin, part), target_key, target_value, delta)
            h = self.after_cross_attention(h, cross, part)
        return h

    # --- construction, loading, saving ------------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target: nn.Module, **config_overrides: Any) -> "LongSpecDraft":
        """A freshly initialised draft for ``target`` (its geometry, dtype and device), bound to it."""
        config = LongSpecDraftConfig.from_target_config(target.config, **config_overrides)
        draft = cls(config)
        ref = next(target.parameters())
        draft.to(device=ref.device, dtype=ref.dtype)
        return draft.eval().bind_target(target)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        target: nn.Module,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
    ) -> "LongSpecDraft":
        """Load a draft checkpoint for ``target``.

        ``pretrained_model_name_or_path`` is a directory (a published draft: the target-style ``config.json`` plus
        safetensors or ``.bin``/``.pth`` weights; what :meth:`save_pretrained` wrote; or a ``longspec train`` run
        directory, which stands for the checkpoint its ``latest`` pointer names), a single weights file
        (``.safetensors``, or a raw ``.pth``/``.pt``/``.bin`` state dict, read with ``weights_only=True``), or a Hub
        repository id. Tensor names carry no prefix or a ``model.`` prefix. Without a ``config.json`` the geometry
        is the target's. dtype and device default to the target's.

        Raises:
            ValueError: missing or unexpected tensors (named), a tensor shape that does not fit the geometry, or a
                checkpoint whose vocabulary/hidden size/heads differ from the target's.
        """
        return load_draft(cls, pretrained_model_name_or_path, target, dtype, device)

    # save_pretrained is transformers': config.json (LongSpecDraftConfig) + model.safetensors with the 20 names, no
    # prefix (the borrowed target is not a submodule, so it is not saved); from_pretrained reads it back.


__all__ = [
    "LongSpecDraft",
    "LongSpecDraftConfig",
    "PUBLISHED_TENSOR_NAMES",
    "check_target_compatible",
    "count_tokens",
    "frequent_tokens",
    "load_draft_vocab",
    "save_draft_vocab",
]
