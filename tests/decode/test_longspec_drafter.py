"""LongSpecDrafter: incremental tree drafting against a dense float64 recomputation, the window, constant memory,
the protocol contract, and lossless greedy decoding through the engine."""
from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from longspec.decode.drafter import DecodeState, Drafter, TreeSpec
from longspec.decode.longspec_drafter import LongSpecDrafter
from longspec.decode.tree import tree_mask_from_parents
from longspec.model.draft import LongSpecDraft
from longspec.model.packing import packed_or_none
from longspec.model.target import StaticKVCache

from ..model.draft_reference import DenseDraft, beam_select, randomize, tiny_target

LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


# --- a minimal engine stand-in: random target K/V, random accepted paths ---------------------------------------------


def make_state(target, prompts: list[list[int]], capacity: int, seed: int) -> DecodeState:
    """A DecodeState over a StaticKVCache of random K/V (the draft only reads rows below seqlens)."""
    g = torch.Generator().manual_seed(seed)
    c = target.config
    B = len(prompts)
    cache = StaticKVCache.from_config(c, B, capacity, torch.float32, "cpu")
    cache.kv.normal_(generator=g)
    cache.seqlens.copy_(torch.tensor([len(p) for p in prompts], dtype=torch.int32))
    tokens = torch.zeros(B, capacity, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    root = torch.randint(0, c.vocab_size, (B,), generator=g)
    return DecodeState(target, cache, tokens, root, torch.ones(B, dtype=torch.bool))


def commit_random_path(state: DecodeState, tree, g: torch.Generator) -> None:
    """Accept a random node's path per row (root first), as the engine would, and draw a new root (the bonus). The
    root committed is the state's (a round that verified no tree of ``tree``'s drafter commits its own root)."""
    V = state.target.config.vocab_size
    for b in range(state.root.shape[0]):
        node = int(torch.randint(0, tree.tokens.shape[1], (1,), generator=g))
        path = []
        while node >= 0:
            path.append(int(tree.tokens[b, node]))
            node = int(tree.parents[b, node])
        r = int(state.seqlens[b])
        path[-1] = int(state.root[b])
        state.tokens[b, r : r + len(path)] = torch.tensor(path[::-1])
        state.cache.seqlens[b] += len(path)
        state.root[b] = int(torch.randint(0, V, (1,), generator=g))


def record_levels(drafter: LongSpecDrafter) -> list:
    """Wrap the drafter's per-level forward to keep its log-probs (float32 [B, M, V] per level)."""
    levels = []
    inner = drafter._level_logits

    def wrapped(*args):
        out = inner(*args)
        levels.append(torch.log_softmax(out.float(), dim=-1))
        return out

    drafter._level_logits = wrapped
    return levels


def check_contract(tree, spec: TreeSpec, root) -> None:
    """DraftTree's contract: [B, T], root first, level order, parents one level up, distinct siblings."""
    B, T = tree.tokens.shape
    assert T == spec.num_nodes and tree.parents.shape == (B, T)
    assert torch.equal(tree.tokens[:, 0], root) and (tree.parents[:, 0] == -1).all()
    depths = spec.depth_tensor("cpu")
    for i in range(1, T):
        assert (depths[tree.parents[:, i]] == depths[i] - 1).all()
    for b in range(B):
        pairs = set(zip(tree.parents[b, 1:].tolist(), tree.tokens[b, 1:].tolist()))
        assert len(pairs) == T - 1
    if tree.mask is not None:  # a drafter's own mask is the engine's verify mask: exactly the parents' ancestry
        assert torch.equal(tree.mask, tree_mask_from_parents(tree.parents, spec))


# --- incremental drafting == dense recomputation ---------------------------------------------------------------------

# (target kind, heads, rope, window, tree shape, prompt lengths, rounds)
CASES = [
    ("llama", (4, 2), None, 6, (3, 5, 4, 2), (11, 4), 4),  # ring wraps; one row shorter than the window
    ("llama", (4, 4), LINEAR_ROPE, 1, (2, 3, 3, 2), (9, 3), 3),  # window < depth - 1: ancestors leave the window
    ("qwen2", (4, 2), None, 512, (4, 6, 4), (530, 200), 3),  # the published window, exceeded by one row
]


@pytest.mark.parametrize("sit_out", [0, 2])
@pytest.mark.parametrize("kind,heads,rope,window,shape,lens,rounds", CASES)
def test_tree_drafting_matches_dense_recomputation(kind, heads, rope, window, shape, lens, rounds, sit_out):
    """``sit_out``: rounds between two proposes that verify no tree of the drafter (a merged drafter's part that
    sits out: up to 2 x (depth + 1) tokens more, more than a small window holds); it catches up through
    ``observe``, each call writing at most ``depth + 1`` positions, as ``propose`` does."""
    target = tiny_target(kind, heads, rope=rope)
    draft = LongSpecDraft.from_target(target, window=window)
    randomize(draft)
    spec = TreeSpec(shape)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in lens]
    state = make_state(target, prompts, max(lens) + (1 + sit_out) * rounds * (spec.depth + 1) + 4, seed=11)
    drafter = LongSpecDrafter(draft)
    assert isinstance(drafter, Drafter)
    drafter.prefill(state, spec)
    levels = record_levels(drafter)
    dense = DenseDraft(draft, target)
    L = target.config.num_hidden_layers
    for _ in range(rounds):
        levels.clear()
        tree = drafter.propose(state, spec)
        assert tree.mask is not None  # the drafter carries its mask to the engine (built once per round)
        check_contract(tree, spec, state.root)
        got = torch.cat(levels, dim=1).double()  # [B, non-leaf nodes, V]
        for b in range(len(lens)):
            r = int(state.seqlens[b])
            want = dense.tree_round(
                state.tokens[b, :r].tolist(), state.root[b], tree, b, spec.depths,
                state.cache.key(L - 1)[b], state.cache.value(L - 1)[b],
            )  # fmt: skip
            inner = spec.offsets[spec.depth]
            torch.testing.assert_close(got[b], want[:inner], atol=2e-4, rtol=1e-4)
            tokens, parents = beam_select(want, tree, b, spec.shape, spec.offsets)
            assert tree.tokens[b, 1:].tolist() == tokens and tree.parents[b, 1:].tolist() == parents
        for i in range(1 + sit_out):
            if i:  # a round it sits out: the engine has it catch up before the round commits
                drafter.observe(state, spec)
            commit_random_path(state, tree, g)


@pytest.mark.parametrize("which", ["longspec", "pld", "streaming"])
def test_graph_state_covers_everything_propose_mutates(which):
    """The engine captures propose as a CUDA graph after a warm-up run whose writes it undoes by restoring
    graph_state(); so re-running propose from restored graph_state() must reproduce the tree and the drafter's state
    exactly, round after round (a mutated tensor missing from graph_state() would make the second run differ)."""
    from longspec import PromptLookupDrafter, StreamingSelfDrafter
    from longspec.model.target import use_longspec_attention

    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target, window=6)
    randomize(draft)
    spec = TreeSpec((2, 3, 2))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (9, 4)]
    state = make_state(target, prompts, 40, seed=5)
    drafter = {"longspec": lambda: LongSpecDrafter(draft), "pld": PromptLookupDrafter,
               "streaming": lambda: StreamingSelfDrafter(sink=2, window=4)}[which]()
    with torch.inference_mode(), use_longspec_attention(target):
        drafter.prefill(state, spec)
        for _ in range(3):
            saved = [t.clone() for t in drafter.graph_state()]
            first = drafter.propose(state, spec)
            after_first = [t.clone() for t in drafter.graph_state()]
            for t, s in zip(drafter.graph_state(), saved):
                t.copy_(s)
            again = drafter.propose(state, spec)
            assert torch.equal(first.tokens, again.tokens) and torch.equal(first.parents, again.parents)
            assert all(torch.equal(a, b) for a, b in zip(after_first, drafter.graph_state()))
            if which != "pld":  # PLD is stateless; the others do write their state
                assert any(not torch.equal(a, b) for a, b in zip(saved, after_first))
            commit_random_path(state, again, g)


def test_window_is_exact_at_512():
    """The root at position r sees draft tokens r-512..r: a change at r-513 is invisible, one at r-512 is not."""
    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target)
    randomize(draft)
    assert draft.config.window == 512
    spec = TreeSpec((3, 3))
    prompt = torch.randint(0, 160, (600,), generator=torch.Generator().manual_seed(2)).tolist()

    def root_logp(change_at=None):
        p = list(prompt)
        if change_at is not None:
            p[change_at] = (p[change_at] + 1) % 160
        state = make_state(target, [p], 640, seed=3)
        drafter = LongSpecDrafter(draft)
        drafter.prefill(state, spec)
        levels = record_levels(drafter)
        tree = drafter.propose(state, spec)
        return levels[0], tree

    base, tree = root_logp()
    outside, tree_outside = root_logp(600 - 513)
    inside, _ = root_logp(600 - 512)
    assert torch.equal(outside, base) and torch.equal(tree_outside.tokens, tree.tokens)
    assert not torch.allclose(inside, base)


# --- constant memory -------------------------------------------------------------------------------------------------


class NewBytes(TorchDispatchMode):
    """Sums the bytes of every new storage an op returns; views of existing tensors (the target cache) don't count."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.total += t.untyped_storage().nbytes()
        return out


def _draft_footprint(context: int) -> dict:
    target = tiny_target("llama", (4, 2), hidden=32, vocab=64, layers=1)
    draft = LongSpecDraft.from_target(target)
    spec = TreeSpec((4, 8, 8))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (context, context - 100)]
    state = make_state(target, prompts, context + 64, seed=1)
    drafter = LongSpecDrafter(draft)
    with FlopCounterMode(display=False) as flops, NewBytes() as prefill_bytes:
        drafter.prefill(state, spec)
    with NewBytes() as propose_bytes:
        for _ in range(2):
            tree = drafter.propose(state, spec)
            commit_random_path(state, tree, g)
    return {
        "cache": drafter.cache.nbytes(),
        "prefill_flops": flops.get_total_flops(),
        "prefill_bytes": prefill_bytes.total,
        "propose_bytes": propose_bytes.total,
    }


def test_draft_memory_is_independent_of_context():
    small, large = _draft_footprint(1024), _draft_footprint(65536)
    assert small == large
    c = LongSpecDraft.from_target(tiny_target("llama", (4, 2), hidden=32, vocab=64, layers=1)).config
    # ring + window (W + 1 rows each, K and V), node K/V, the tree's mask (root included), ring_end
    T1, W1, f32 = 20, c.window + 1, 4
    expected = 4 * 2 * W1 * 2 * 8 * f32 + 2 * 2 * T1 * 2 * 8 * f32 + 2 * (T1 + 1) ** 2 + 2 * 8
    assert small["cache"] == expected


class GemmShapes(TorchDispatchMode):
    """(rows, output columns) of every matrix product dispatched: which projections ran, on how many rows."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.linear, torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                                   torch.ops.longspec.fused_linear):  # drafting's linears (norm etc. folded in)
            self.shapes.append((out.shape[:-1].numel(), out.shape[-1]))
        return out


def test_prefill_runs_only_the_windows_self_kv():
    """Prefill projects K/V for exactly the last W positions per row (one packed k/v GEMM): no queries,
    cross-attention or MLP; drafting never runs the dead cross-attention k/v projections, and re-feeds only the
    positions a round can have committed."""
    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target, window=16)
    c = draft.config
    state = make_state(target, [list(range(100)), list(range(40))], 128, seed=0)
    drafter = LongSpecDrafter(draft)
    with torch.inference_mode(), GemmShapes() as gemms:
        drafter.prefill(state, TreeSpec((2, 2)))
    assert gemms.shapes == [(2 * 16, 2 * c.num_key_value_heads * c.head_dim)]
    rows = {}
    handles = [m.register_forward_hook(lambda _m, inputs, _o, n=n: rows.setdefault(n, inputs[0].shape))
               for n, m in (("cross_k", draft.cross_attn.k_proj), ("cross_v", draft.cross_attn.v_proj))]
    with torch.inference_mode(), GemmShapes() as gemms:
        drafter.propose(state, TreeSpec((2, 2)))
    assert rows == {}  # dead projections never run
    for h in handles:
        h.remove()
    # propose's first product is the re-feed: depth + 1 = 3 positions a row (at most that many were committed since
    # the last call), not the window's W + 1 = 17; no product runs on that many rows
    assert gemms.shapes[0] == (2 * 3, 2 * c.num_key_value_heads * c.head_dim), gemms.shapes
    assert all(rows_ < 2 * 17 for rows_, _ in gemms.shapes), gemms.shapes


def test_packed_projections_equal_the_parameters():
    """Drafting's packed q/k/v and gate/up GEMMs give the unpacked module's values; the packing holds no second
    copy, survives a state-dict round trip, and is redone after .to() gave the parameters new storage."""
    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target, window=16)
    randomize(draft)
    x = torch.randn(2, 5, draft.config.hidden_size)
    pos = torch.arange(5).expand(2, 5)
    cos, sin = draft.rope(x, pos)
    h1 = torch.randn_like(x)
    cross = torch.randn(2, 5, draft.config.num_attention_heads, draft.config.head_dim)
    with torch.no_grad():
        want = draft.self_qkv(x, cos, sin), draft.after_cross_attention(h1, cross)
        state = {k: v.clone() for k, v in draft.state_dict().items()}
        draft.pack_for_drafting()
        got = draft.self_qkv(x, cos, sin), draft.after_cross_attention(h1, cross)
        kv_only = draft.self_qkv(x, cos, sin, need_q=False)
    for a, b in zip(list(want[0]) + [want[1]], list(got[0]) + [got[1]]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert kv_only[0] is None and torch.equal(kv_only[1], got[0][1]) and torch.equal(kv_only[2], got[0][2])
    packed = draft._packed
    assert draft.self_attn.k_proj.weight.untyped_storage().data_ptr() == packed.qkv_weight.untyped_storage().data_ptr()
    assert all(torch.equal(v, state[k]) for k, v in draft.state_dict().items())
    draft.to(torch.float64)
    assert packed_or_none(draft._packed) is None  # new storage: the old packing no longer applies ...
    draft.pack_for_drafting()
    assert packed_or_none(draft._packed) is not None and draft._packed.qkv_weight.dtype == torch.float64  # ... redone


def test_observe_compiled_writes_what_eager_writes():
    """compile=True compiles ``observe`` (a budget's plain rounds run it in their draft step): it traces as one
    torch.compile graph and writes the caches the eager call writes, over rounds it sits out one after another, each
    committing 1 to 3 tokens (a window of 6 and depth 2: every call writes up to 3 positions)."""
    target = tiny_target("llama", (4, 2))
    draft = LongSpecDraft.from_target(target, window=6)
    randomize(draft)
    spec = TreeSpec((2, 3))
    g = torch.Generator().manual_seed(5)
    state = make_state(target, [torch.randint(0, 160, (n,), generator=g).tolist() for n in (9, 4)], 60, seed=2)
    eager, compiled = LongSpecDrafter(draft), LongSpecDrafter(draft)
    observe = torch.compile(compiled.observe, fullgraph=True)
    eager.prefill(state, spec)
    compiled.prefill(state, spec)
    tree = eager.propose(state, spec)
    compiled.propose(state, spec)
    for _ in range(5):
        commit_random_path(state, tree, g)
        eager.observe(state, spec)
        observe(state, spec)
        for name, want in vars(eager.cache).items():
            torch.testing.assert_close(getattr(compiled.cache, name), want, rtol=1e-6, atol=1e-6, msg=name)


# --- checks ----------------------------------------------------------------------------------------------------------


def test_prefill_rejects_an_incompatible_target():
    target = tiny_target("llama", (4, 2))
    drafter = LongSpecDrafter(LongSpecDraft.from_target(target))
    other = tiny_target("llama", (4, 2), vocab=200)
    with pytest.raises(ValueError, match=r"vocab_size \(160\) does not match the target's vocab_size \(200\)"):
        drafter.prefill(make_state(other, [[1, 2, 3]], 16, seed=0), TreeSpec((2,)))
    state = make_state(target, [[1, 2, 3]], 16, seed=0)
    state.cache.kv = state.cache.kv.double()
    with pytest.raises(ValueError, match="last-layer cache"):
        drafter.prefill(state, TreeSpec((2,)))
    with pytest.raises(ValueError, match="tree level 2 asks for 400 nodes"):
        drafter.prefill(make_state(target, [[1, 2, 3]], 16, seed=0), TreeSpec((2, 400)))
    with pytest.raises(RuntimeError, match="prefill"):
        LongSpecDrafter(LongSpecDraft.from_target(target)).propose(state, TreeSpec((2,)))
    with pytest.raises(RuntimeError, match="observe needs prefill"):
        LongSpecDrafter(LongSpecDraft.from_target(target)).observe(state, TreeSpec((2,)))


# --- lossless through the engine -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,batch,kv_update,fp8", [
    (kind, batch, kv, False) for kind in ("llama", "qwen2") for batch in (1, 2) for kv in ("COMMIT", "REFEED")
] + [("llama", 2, "COMMIT", True)])
def test_greedy_speculative_equals_greedy(kind, batch, kv_update, fp8):
    """A random LongSpec draft in SpeculativeDecoder reproduces the target's own greedy decoding token for token
    (also when it drafts with float8 weight copies)."""
    decoder_mod = pytest.importorskip("longspec.decode.decoder")
    target = tiny_target(kind, (4, 2), vocab=32, layers=2, seed=4)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    draft = LongSpecDraft.from_target(target, window=6)
    randomize(draft, seed=5)
    g = torch.Generator().manual_seed(6)
    lens = [13, 7][:batch]
    prompts = [torch.randint(0, 32, (n,), generator=g) for n in lens]
    S, new = max(lens), 24
    ids = torch.zeros(batch, S, dtype=torch.int64)
    mask = torch.zeros(batch, S, dtype=torch.int64)
    for b, p in enumerate(prompts):  # left padding
        ids[b, S - len(p) :], mask[b, S - len(p) :] = p, 1
    drafter = LongSpecDrafter(draft, weight_dtype=torch.float8_e4m3fn if fp8 else None)
    decoder = decoder_mod.SpeculativeDecoder(target, drafter, tree_shape=(8, 8, 8),
                                             kv_update=decoder_mod.KVUpdate[kv_update])
    out = decoder.generate(ids, max_new_tokens=new, eos_token_id=[], attention_mask=mask)
    for b, p in enumerate(prompts):
        want = target.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                               do_sample=False, max_new_tokens=new)[0, len(p):]
        assert out.sequences[b, S:].tolist() == want.tolist()
    assert max(max(row) for row in out.accept_lengths) >= 2  # multi-token commits exercised the re-feed
    assert (draft._packed.fp8 is not None) == fp8
