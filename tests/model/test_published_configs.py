"""The real-size benchmarks build their targets from published configurations: check the geometry."""
from __future__ import annotations

import pytest

from longspec.testing import PUBLISHED_CONFIGS, published_target


@pytest.mark.parametrize("name,params,cls", [("Llama-3-8B", 8_030_261_248, "LlamaForCausalLM"),
                                             ("Qwen2.5-32B", 32_763_876_352, "Qwen2ForCausalLM"),
                                             ("Qwen2.5-72B", 72_706_203_648, "Qwen2ForCausalLM")])
def test_published_configs_have_the_published_parameter_counts(name, params, cls):
    model = published_target(name, device="meta")  # no memory: shapes only
    assert type(model).__name__ == cls
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.config.max_position_embeddings >= 131072 + 512
    assert set(PUBLISHED_CONFIGS) == {"Llama-3-8B", "Qwen2.5-32B", "Qwen2.5-72B"}
