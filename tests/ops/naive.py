"""An independent naive float64 attention: explicit KV-head repetition, a full boolean mask and a hand-written
softmax. The references in ``longspec_ops.reference`` are checked against it; it shares no code with them."""
from __future__ import annotations

import torch


def naive_attention(q, k, v, visible, scale):
    """q [B,M,Hq,D]; k, v [B,S,Hkv,D]; visible bool [B,M,S]. Returns out float64 [B,M,Hq,D], lse float64 [B,Hq,M]."""
    B, M, Hq, D = q.shape
    group = Hq // k.shape[2]
    out = torch.zeros(B, M, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, M), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kh = k[b, :, h // group].double()
            vh = v[b, :, h // group].double()
            for i in range(M):
                cols = visible[b, i].nonzero().flatten()
                if cols.numel() == 0:
                    continue
                s = (kh[cols] @ q[b, i, h].double()) * scale
                mx = s.max()
                e = torch.exp(s - mx)
                out[b, i, h] = (e[:, None] * vh[cols]).sum(0) / e.sum()
                lse[b, h, i] = mx + torch.log(e.sum())
    return out, lse


def hybrid_visibility(cache_seqlens, N, tree_mask):
    """[B, M, N + M]: cache rows below the length, then the tree block under its mask."""
    B, M, _ = tree_mask.shape
    rows = torch.arange(N)[None, None, :] < cache_seqlens.long()[:, None, None]
    return torch.cat([rows.expand(B, M, N), tree_mask], dim=-1)


