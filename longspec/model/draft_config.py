"""The configuration of a LongSpec draft: the target's geometry plus the self-attention window, and the check that a
target fits it."""
from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedConfig

from longspec.model.target import head_dim, num_kv_heads


_CONFIG_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_act",
    "rms_norm_eps", "initializer_range", "mlp_bias", "vocab_size",
)  # fmt: skip


@strict
class LongSpecDraftConfig(PreTrainedConfig):
    """Configuration of a :class:`LongSpecDraft`; the geometry fields mirror the target's config.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (the published drafts' rule); ``window`` is the
    self-attention window W (a query at position t sees keys at positions t-W..t, W + 1 keys with itself).
    ``vocab_size`` is informational: it is checked against the target, whose embeddings and LM head are used.
    ``extra_cross_blocks`` (0 for the method's, and every published, draft) adds that many cross-attention + MLP
    blocks after the block (:class:`~longspec.model.draft_blocks.CrossBlock`; not part of the LongSpec method).
    """

    model_type = "longspec_draft"

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 11008
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    mlp_bias: bool = False
    window: int = 512
    extra_cross_blocks: int = 0

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Called by ``@strict``: the head geometry must be usable by the attention ops."""
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if isinstance(self.extra_cross_blocks, bool) or self.extra_cross_blocks < 0:
            raise ValueError(f"extra_cross_blocks must be an int >= 0, got {self.extra_cross_blocks!r}")

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "LongSpecDraftConfig":
        """The draft config for a target: its geometry, activation, eps and init range; ``overrides`` win.

        head_dim is the target's (its cache is what the cross-attention reads), which equals
        ``hidden_size // num_attention_heads`` for every published target.
        """
        text = target_config.get_text_config()
        fields = {name: getattr(text, name) for name in _CONFIG_FIELDS if getattr(text, name, None) is not None}
        fields["head_dim"] = head_dim(text)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_checkpoint_json(cls, config_dict: dict, target_config: PreTrainedConfig) -> "LongSpecDraftConfig":
        """Read a checkpoint's ``config.json``: ours (model_type ``longspec_draft``) or a published target-style one.

        A target-style config (the published drafts ship the target's ``config.json``) contributes the fields the
        authors' draft reads; head_dim is then ``hidden_size // num_attention_heads``, as in their code.
        """
        if config_dict.get("model_type") == cls.model_type:
            return cls.from_dict(config_dict)
        fields = {name: config_dict[name] for name in _CONFIG_FIELDS if config_dict.get(name) is not None}
        missing = [n for n in ("hidden_size", "num_attention_heads") if n not in fields]
        if missing:
            raise ValueError(f"checkpoint config.json lacks {', '.join(missing)}")
        fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        fields.setdefault("vocab_size", target_config.get_text_config().vocab_size)
        return cls(**fields)


def check_target_compatible(config: LongSpecDraftConfig, target: nn.Module) -> None:
    """Raise ValueError unless the draft's geometry and vocabulary match ``target``'s.

    The cross-attention reads the target's cache (heads, head_dim), the input is the target's embeddings (hidden
    size) and the output its LM head (vocabulary).
    """
    text = target.config.get_text_config()
    pairs = (
        ("hidden_size", config.hidden_size, text.hidden_size),
        ("num_attention_heads", config.num_attention_heads, text.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads, num_kv_heads(text)),
        ("head_dim", config.head_dim, head_dim(text)),
        ("vocab_size", config.vocab_size, text.vocab_size),
    )
    for name, mine, theirs in pairs:
        if mine != theirs:
            raise ValueError(f"draft {name} ({mine}) does not match the target's {name} ({theirs})")
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    for what, module in (("input embeddings", embed), ("LM head", head)):
        if module is not None and module.weight.shape[0] != config.vocab_size:
            raise ValueError(
                f"the target's {what} have {module.weight.shape[0]} rows, the draft's vocabulary is {config.vocab_size}"
            )
        if module is not None and module.weight.shape[1] != config.hidden_size:
            raise ValueError(
                f"the target's {what} have width {module.weight.shape[1]}, the draft's hidden size is "
                f"{config.hidden_size}"
            )
