"""StreamingSelfDrafter: the sink + window view, and drafting equal to the target's own argmax."""
from __future__ import annotations

import torch

from longspec import StreamingSelfDrafter
from longspec.decode.drafter import DecodeState, TreeSpec
from longspec.model.target import StaticKVCache

from .tiny_targets import ragged_batch, tiny_target


def test_view_gathers_sink_and_recent_rows_of_every_layer():
    cache = StaticKVCache(num_layers=2, batch_size=3, max_len=40, num_kv_heads=1, head_dim=2,
                          dtype=torch.float32, device="cpu")
    cache.kv[:] = torch.arange(40, dtype=torch.float32)[:, None, None]  # every value = its row index
    cache.kv[1] += 100  # layer 1 differs
    cache.seqlens.copy_(torch.tensor([30, 5, 9], dtype=torch.int32))
    drafter = StreamingSelfDrafter(sink=2, window=6)
    state = DecodeState(None, cache, torch.zeros(3, 41, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                        torch.ones(3, dtype=torch.bool))
    drafter.prefill(state, TreeSpec((1, 1)))
    drafter._gather_view(cache)
    view = drafter._view
    assert view.seqlens.tolist() == [8, 5, 8]
    assert view.kv[0, 0, 0, :8, 0, 0].tolist() == [0, 1, 24, 25, 26, 27, 28, 29]  # sink + last 6 rows
    assert view.kv[0, 1, 1, :5, 0, 0].tolist() == [0, 1, 2, 3, 4]  # short row: everything
    assert view.kv[1, 0, 2, :8, 0, 0].tolist() == [100, 101, 103, 104, 105, 106, 107, 108]


def test_full_view_drafts_the_targets_greedy_continuation():
    """When the view covers the context, a chain draft is the target's own greedy continuation."""
    model = tiny_target("qwen2-mha-d128")
    ids, _ = ragged_batch([20], seed=5)
    spec = TreeSpec((1, 1, 1))
    want = model.generate(ids, do_sample=False, max_new_tokens=4, eos_token_id=None)[0, 20:]
    from longspec import SpeculativeDecoder

    dec = SpeculativeDecoder(model, StreamingSelfDrafter(sink=4, window=64), tree_shape=spec.shape)
    out = dec.generate(ids, max_new_tokens=4, eos_token_id=[])
    assert out.sequences[0, 20:].tolist() == want.tolist()
    assert out.accept_lengths == [[3]]  # root from the prefill, then one round: 2 drafts + the bonus
