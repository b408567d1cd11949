"""Test helpers for the LongSpec draft: tiny targets, published-format checkpoints and an independent dense float64
implementation of the draft block.

The dense implementation shares no code with ``longspec.model.draft``: it reads the weights, recomputes RoPE from
the target's config (default and linear scaling), and runs every attention as an explicit softmax over an explicit
list of visible keys.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from longspec.decode.drafter import DraftTree

from ..ops.naive import naive_attention


def tiny_target(
    kind: str = "llama",
    heads: tuple[int, int] = (4, 2),
    hidden: int = 64,
    vocab: int = 160,
    layers: int = 2,
    rope: dict | None = None,
    seed: int = 0,
    spread: float = 1.0,
):
    """A random float32 target in eval mode. ``spread`` rescales the embeddings and LM head so logits are O(1):
    well-separated top-k choices make float32-vs-float64 token comparisons exact."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads[0], num_key_value_heads=heads[1], max_position_embeddings=1 << 17,
    )  # fmt: skip
    if rope is not None:
        common["rope_parameters"] = rope
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, spread)
        model.get_output_embeddings().weight.normal_(0.0, spread / math.sqrt(hidden))
    return model.eval()


def published_state_dict(hidden: int, heads: tuple[int, int], inter: int, seed: int = 1, std: float = 0.2) -> dict:
    """The 20 tensors of a published LongSpec checkpoint (random values), shaped for the given geometry."""
    g = torch.Generator().manual_seed(seed)
    D = hidden // heads[0]
    out_dims = {"q": heads[0] * D, "k": heads[1] * D, "v": heads[1] * D}
    sd = {}
    for attn in ("self_attn", "cross_attn"):
        for p, rows in out_dims.items():
            sd[f"{attn}.{p}_proj.weight"] = torch.randn(rows, hidden, generator=g) * std
            sd[f"{attn}.{p}_proj.bias"] = torch.randn(rows, generator=g) * std
        sd[f"{attn}.o_proj.weight"] = torch.randn(hidden, heads[0] * D, generator=g) * std
    sd["mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g) * std
    sd["mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g) * std
    sd["mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g) * std
    for n in ("input_layernorm", "post_self_attention_layernorm", "post_cross_attention_layernorm"):
        sd[f"{n}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    return sd


def randomize(draft, seed: int = 1, std: float = 0.2) -> None:
    """Give every draft parameter (biases and norms included) non-trivial random values."""
    c = draft.config
    heads = (c.num_attention_heads, c.num_key_value_heads)
    sd = published_state_dict(c.hidden_size, heads, c.intermediate_size, seed, std)
    g = torch.Generator().manual_seed(seed + 1000)
    for name, t in draft.state_dict().items():  # the extra cross blocks (extra_cross_blocks), if any
        if name.startswith("extra_blocks."):
            sd[name] = (1.0 + 0.1 * torch.randn(t.shape, generator=g) if name.endswith("norm.weight")
                        else torch.randn(t.shape, generator=g) * std)
    draft.load_state_dict(sd)


class DenseDraft:
    """The draft block in float64 from first principles, one batch row at a time."""

    def __init__(self, draft, target) -> None:
        self.w = {n: t.detach().double() for n, t in draft.state_dict().items()}
        self.embed = target.get_input_embeddings().weight.detach().double()
        self.head = target.get_output_embeddings().weight.detach().double()
        c = draft.config
        self.Hq, self.Hkv, self.D = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
        self.eps, self.window, self.extra = c.rms_norm_eps, c.window, c.extra_cross_blocks
        rope = target.config.rope_parameters
        inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, self.D, 2, dtype=torch.float64) / self.D)
        if rope.get("rope_type", "default") == "linear":
            inv = inv / rope["factor"]
        else:
            assert rope.get("rope_type", "default") == "default", rope
        self.inv_freq = inv

    def _norm(self, x: Tensor, name: str) -> Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    def _lin(self, x: Tensor, name: str) -> Tensor:
        y = x @ self.w[f"{name}.weight"].T
        return y + self.w[f"{name}.bias"] if f"{name}.bias" in self.w else y

    def _rope(self, x: Tensor, pos: Tensor) -> Tensor:
        """x [S, H, D] rotated at positions pos [S] (rotate-half convention)."""
        ang = pos.double()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None, :], torch.cat([ang.sin()] * 2, -1)[:, None, :]
        half = self.D // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    @staticmethod
    def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One query q [Hq, D] over all keys k, v [n, Hkv, D] (the tests' naive float64 attention)."""
        visible = torch.ones(1, 1, k.shape[0], dtype=torch.bool)
        out, _ = naive_attention(q[None, None], k[None], v[None], visible, 1.0 / math.sqrt(q.shape[-1]))
        return out[0, 0]

    def logits(self, tokens, positions, queries, visible, target_k, target_v, target_rows) -> Tensor:
        """Logits float64 [len(queries), V] for one row.

        tokens, positions: int [S] every item a query may see; queries: item indices; visible[i]: the item
        indices query i attends to (itself included); target_k/v: [N, Hkv, D]; target_rows[i]: rows [0, n) seen.
        """
        tokens, positions = torch.as_tensor(tokens), torch.as_tensor(positions)
        S = tokens.numel()
        x = self.embed[tokens]
        n1 = self._norm(x, "input_layernorm")
        k = self._rope(self._lin(n1, "self_attn.k_proj").view(S, self.Hkv, self.D), positions)
        v = self._lin(n1, "self_attn.v_proj").view(S, self.Hkv, self.D)
        q = self._rope(self._lin(n1, "self_attn.q_proj").view(S, self.Hq, self.D), positions)
        tk, tv = target_k.double(), target_v.double()
        rows = []
        for i, item in enumerate(queries):
            idx = torch.as_tensor(visible[i], dtype=torch.long)
            sa = self._attend(q[item], k[idx], v[idx]).reshape(-1)
            h1 = x[item] + self._lin(sa, "self_attn.o_proj")
            n2 = self._norm(h1, "post_self_attention_layernorm")
            qc = self._rope(self._lin(n2, "cross_attn.q_proj").view(1, self.Hq, self.D), positions[item : item + 1])[0]
            n = int(target_rows[i])
            ca = self._attend(qc, tk[:n], tv[:n]).reshape(-1)
            h2 = h1 + self._lin(ca, "cross_attn.o_proj")
            n3 = self._norm(h2, "post_cross_attention_layernorm")
            g = self._lin(n3, "mlp.gate_proj")
            out = h2 + self._lin(g * torch.sigmoid(g) * self._lin(n3, "mlp.up_proj"), "mlp.down_proj")
            for e in range(self.extra):  # extra cross blocks: cross-attention + MLP, no self-attention
                p = f"extra_blocks.{e}."
                nq = self._norm(out, p + "cross_norm")
                qe = self._rope(self._lin(nq, p + "cross_attn.q_proj").view(1, self.Hq, self.D),
                                positions[item : item + 1])[0]
                h2 = out + self._lin(self._attend(qe, tk[:n], tv[:n]).reshape(-1), p + "cross_attn.o_proj")
                nm = self._norm(h2, p + "mlp_norm")
                g = self._lin(nm, p + "mlp.gate_proj")
                out = h2 + self._lin(g * torch.sigmoid(g) * self._lin(nm, p + "mlp.up_proj"), p + "mlp.down_proj")
            rows.append(out @ self.head.T)  # no final norm
        return torch.stack(rows)

    def sequence_logits(self, tokens, target_k, target_v, delta: int = 1) -> Tensor:
        """A whole sequence at positions 0..S-1: causal, window W, token t sees target rows <= t - delta."""
        S = len(tokens)
        vis = [[j for j in range(S) if i - self.window <= j <= i] for i in range(S)]
        rows = [max(0, i - delta + 1) for i in range(S)]
        return self.logits(tokens, list(range(S)), list(range(S)), vis, target_k, target_v, rows)

    def tree_round(self, history, root, tree: DraftTree, b: int, depths, target_k, target_v):
        """Reference log-probs (float64 [T, V], rows of leaves are NaN) of every node of row b's tree.

        history: the row's committed tokens (positions 0..r-1); root at position r. A node at position p sees the
        committed tokens and path nodes at positions p - W .. p, and the target rows before the root.
        """
        r = len(history)
        tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
        assert tokens[0] == int(root)
        T, depth = len(tokens), max(depths)
        items_tok = list(history) + tokens  # committed items 0..r-1, then node i at item r + i
        items_pos = list(range(r)) + [r + d for d in depths]
        queries, visible = [], []
        for i in range(T):
            if depths[i] == depth:
                continue
            p = r + depths[i]
            path, j = [], i
            while j >= 0:
                path.append(r + j)
                j = parents[j]
            lo = p - self.window
            vis = [s for s in range(r) if s >= lo] + [it for it in path if items_pos[it] >= lo]
            queries.append(r + i)
            visible.append(vis)
        logits = self.logits(items_tok, items_pos, queries, visible, target_k, target_v, [r] * len(queries))
        out = torch.full((T, self.head.shape[0]), float("nan"), dtype=torch.float64)
        out[[q - r for q in queries]] = torch.log_softmax(logits, -1)
        return out


def beam_select(logp: Tensor, tree: DraftTree, b: int, shape, offsets) -> tuple[list, list]:
    """Re-run the beam selection on reference log-probs over row b's nodes: (tokens, parents) of depths >= 1."""
    cum = torch.zeros(tree.tokens.shape[1], dtype=torch.float64)
    tokens, parents = [], []
    V = logp.shape[1]
    for d, k in enumerate(shape):
        lo, hi = offsets[d], offsets[d + 1]
        scores = (cum[lo:hi, None] + logp[lo:hi]).reshape(-1)
        top, idx = scores.topk(k)
        tokens += (idx % V).tolist()
        parents += (idx // V + lo).tolist()
        # Cumulative scores of the drafted nodes (the reference's own values along the drafter's tree).
        nlo, nhi = offsets[d + 1], offsets[d + 2]
        par = tree.parents[b, nlo:nhi]
        cum[nlo:nhi] = cum[par] + logp[par, tree.tokens[b, nlo:nhi]]
    return tokens, parents
