"""Argument checks shared by the fake, CPU and CUDA implementations of every ``longspec`` op.

Metadata checks (rank, dtype, shape, device, strides) run in every implementation, fake tensors included. Checks
that read tensor *values* (lengths beyond the cache) run in the CPU ops and in the typed wrappers of
:mod:`longspec_ops.ops`; they skip themselves where reading a value would be illegal (fake tensors, tracing, graph
capture). The raw CUDA ops never read values on the host; their kernels clamp lengths to the cache size so a bad
value can never read out of bounds.
"""
from __future__ import annotations

import torch
from torch import Tensor

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int32, torch.int64)
MAX_ACCEPT = 1024  # commit_kv_'s CUDA kernel stages one row's accepted path in shared memory


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"longspec.{op}: {msg}")


def _rank(op: str, name: str, t: Tensor, rank: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        _fail(op, f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def _last_dim_contiguous(op: str, name: str, t: Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(t.stride())}")


def _same_device(op: str, **tensors: Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        _fail(op, "all tensors must be on one device, got " + ", ".join(f"{n} on {d}" for n, d in devices.items()))


def _heads(op: str, q: Tensor, kname: str, k: Tensor) -> None:
    Hq, Hkv = q.shape[2], k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        _fail(op, f"q's head count ({Hq}) must be a multiple of {kname}'s head count ({Hkv})")


def _qkv(op: str, q: Tensor, kname: str, k: Tensor, vname: str, v: Tensor, kv_layout: str) -> None:
    _rank(op, "q", q, 4, "[B, M, Hq, D]")
    _rank(op, kname, k, 4, kv_layout)
    _rank(op, vname, v, 4, kv_layout)
    if q.dtype not in _FLOATS:
        _fail(op, f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, t in ((kname, k), (vname, v)):
        if t.dtype != q.dtype:
            _fail(op, f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if k.shape != v.shape:
        _fail(op, f"{kname} and {vname} must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        _fail(op, f"{kname} batch ({k.shape[0]}) must equal q's batch ({q.shape[0]})")
    if k.shape[3] != q.shape[3]:
        _fail(op, f"{kname} head dim ({k.shape[3]}) must equal q's head dim ({q.shape[3]})")
    _heads(op, q, kname, k)
    for name, t in (("q", q), (kname, k), (vname, v)):
        _last_dim_contiguous(op, name, t)


def _lengths(op: str, name: str, lens: Tensor, q: Tensor, allow_per_query: bool) -> None:
    if not isinstance(lens, Tensor):
        _fail(op, f"{name} must be an int32 Tensor, got {type(lens).__name__}")
    if lens.dtype not in _INTS:
        _fail(op, f"{name} must be int32 (or int64), got {lens.dtype}")
    B, M = q.shape[0], q.shape[1]
    ok = [(B,)] + ([(B, M)] if allow_per_query else [])
    if tuple(lens.shape) not in ok:
        want = "[B] or [B, M]" if allow_per_query else "[B]"
        _fail(op, f"{name} must have shape {want} = {' or '.join(str(s) for s in ok)}, got {tuple(lens.shape)}")


def _mask(op: str, tree_mask: Tensor, q: Tensor, num_keys: int) -> None:
    _rank(op, "tree_mask", tree_mask, 3, "[B, M, K]")
    if tree_mask.dtype != torch.bool:
        _fail(op, f"tree_mask must be bool, got {tree_mask.dtype}")
    want = (q.shape[0], q.shape[1], num_keys)
    if tuple(tree_mask.shape) != want:
        _fail(op, f"tree_mask must have shape [B, M, K] = {want} (M queries, K tree keys), got "
                  f"{tuple(tree_mask.shape)}")


def _scale(op: str, scale: float) -> None:
    if not (scale > 0.0) or scale == float("inf"):
        _fail(op, f"scale must be a finite positive float, got {scale}")


def check_merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    op = "merge_attn_states"
    _rank(op, "out_a", out_a, 4, "[B, M, H, D]")
    _rank(op, "lse_a", lse_a, 3, "[B, H, M]")
    if out_b.shape != out_a.shape:
        _fail(op, f"out_b must have out_a's shape {tuple(out_a.shape)}, got {tuple(out_b.shape)}")
    if out_a.dtype not in _FLOATS:
        _fail(op, f"out_a must be float16, bfloat16, float32 or float64, got {out_a.dtype}")
    if out_b.dtype != out_a.dtype:
        _fail(op, f"out_b must have out_a's dtype {out_a.dtype}, got {out_b.dtype}")
    B, M, H, _ = out_a.shape
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != (B, H, M):
            _fail(op, f"{name} must have shape [B, H, M] = {(B, H, M)}, got {tuple(lse.shape)}")
        if lse.dtype != torch.float32:
            _fail(op, f"{name} must be float32, got {lse.dtype}")
    _last_dim_contiguous(op, "out_a", out_a)
    _last_dim_contiguous(op, "out_b", out_b)
    _same_device(op, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)


def check_tree(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, scale: float) -> None:
    op = "tree_attn"
    _qkv(op, q, "k", k, "v", v, "[B, K, Hkv, D]")
    _mask(op, tree_mask, q, k.shape[1])
    _scale(op, scale)
    _same_device(op, q=q, k=k, v=v, tree_mask=tree_mask)


def check_prefix(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor, scale: float) -> None:
    op = "prefix_attn"
    _qkv(op, q, "k_cache", k_cache, "v_cache", v_cache, "[B, N, Hkv, D]")
    _lengths(op, "kv_lens", kv_lens, q, allow_per_query=True)
    _scale(op, scale)
    _same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, kv_lens=kv_lens)


def check_hybrid(q, k_cache, v_cache, cache_seqlens, k_tree, v_tree, tree_mask, scale) -> None:
    op = "hybrid_tree_attn"
    _qkv(op, q, "k_cache", k_cache, "v_cache", v_cache, "[B, N, Hkv, D]")
    _qkv(op, q, "k_tree", k_tree, "v_tree", v_tree, "[B, K, Hkv, D]")
    if k_tree.shape[2] != k_cache.shape[2]:
        _fail(op, f"k_tree heads ({k_tree.shape[2]}) must equal k_cache heads ({k_cache.shape[2]})")
    _lengths(op, "cache_seqlens", cache_seqlens, q, allow_per_query=False)
    _mask(op, tree_mask, q, k_tree.shape[1])
    _scale(op, scale)
    _same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                 k_tree=k_tree, v_tree=v_tree, tree_mask=tree_mask)


def check_draft_cross(q, k_cache, v_cache, q_pos, cache_seqlens, scale) -> None:
    op = "draft_cross_attn"
    _qkv(op, q, "k_cache", k_cache, "v_cache", v_cache, "[B, N, Hkv, D]")
    _lengths(op, "cache_seqlens", cache_seqlens, q, allow_per_query=False)
    if not isinstance(q_pos, Tensor) or q_pos.dtype not in _INTS:
        _fail(op, f"q_pos must be an int32 Tensor [B, M], got {getattr(q_pos, 'dtype', type(q_pos).__name__)}")
    if tuple(q_pos.shape) != tuple(q.shape[:2]):
        _fail(op, f"q_pos must have shape [B, M] = {tuple(q.shape[:2])}, got {tuple(q_pos.shape)}")
    _scale(op, scale)
    _same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, q_pos=q_pos, cache_seqlens=cache_seqlens)


def check_commit(kv_cache: Tensor, cache_seqlens: Tensor, accept_index: Tensor, accept_lens: Tensor) -> None:
    op = "commit_kv_"
    _rank(op, "kv_cache", kv_cache, 5, "[P, B, N, Hkv, D] (P = 2 x layers)")
    if not kv_cache.is_contiguous():
        _fail(op, "kv_cache must be contiguous (one preallocated tensor for all layers)")
    B = kv_cache.shape[1]
    for name, t in (("cache_seqlens", cache_seqlens), ("accept_lens", accept_lens)):
        if t.dtype not in _INTS or tuple(t.shape) != (B,):
            _fail(op, f"{name} must be int32 [B] = ({B},), got {t.dtype} {tuple(t.shape)}")
    if accept_index.dtype not in _INTS or accept_index.dim() != 2 or accept_index.shape[0] != B:
        _fail(op, f"accept_index must be int32 [B, A] with B = {B}, got {accept_index.dtype} {tuple(accept_index.shape)}")
    if accept_index.shape[1] > MAX_ACCEPT:
        _fail(op, f"accept_index may hold at most {MAX_ACCEPT} entries per row, got {accept_index.shape[1]}")
    _same_device(op, kv_cache=kv_cache, cache_seqlens=cache_seqlens, accept_index=accept_index, accept_lens=accept_lens)


def _values_readable(*ts: Tensor) -> bool:
    """Whether value checks may run: real tensors, outside graph capture and tracing."""
    if torch.compiler.is_compiling():
        return False
    for t in ts:
        if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
            return False
        if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
    return True


def check_lengths(op: str, name: str, lens: Tensor, limit: int, *, low: int = 0, why: str | None = None) -> None:
    """Every value of ``lens`` must lie in [low, limit] (``why``: what the bound is, default the cache's rows). Syncs
    a CUDA device; skipped under capture or tracing."""
    if lens.numel() == 0 or not _values_readable(lens):
        return
    lo, hi = int(lens.min()), int(lens.max())
    if lo < low or hi > limit:
        why = f"the cache holds {limit} rows" if why is None else why
        _fail(op, f"{name} values must lie in [{low}, {limit}] ({why}), got min {lo}, max {hi}")


def check_commit_values(kv_cache: Tensor, cache_seqlens: Tensor, accept_index: Tensor, accept_lens: Tensor) -> None:
    op = "commit_kv_"
    if not _values_readable(cache_seqlens, accept_index, accept_lens):
        return
    N, A = kv_cache.shape[2], accept_index.shape[1]
    check_lengths(op, "accept_lens", accept_lens, A)
    valid = torch.arange(A, device=accept_index.device)[None, :] < accept_lens.to(torch.int64)[:, None]
    if not bool(valid.any()):
        return
    idx = accept_index.to(torch.int64)
    if int(torch.where(valid, idx, 0).min()) < 0:
        _fail(op, "accept_index values must be >= 0")
    base = cache_seqlens.to(torch.int64)[:, None]
    reach = int(torch.where(valid, base + torch.maximum(idx, torch.arange(A, device=idx.device)), 0).max())
    if reach > N - 1:
        _fail(op, f"cache_seqlens + accept_index reaches row {reach}, beyond the cache's {N} rows")


def check_invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    op = "invariant_linear"
    if not isinstance(x, Tensor) or x.dim() < 1:
        _fail(op, f"x must be a Tensor [..., K], got {getattr(x, 'shape', type(x).__name__)}")
    _rank(op, "weight", weight, 2, "[N, K]")
    if x.dtype not in _FLOATS:
        _fail(op, f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if weight.dtype != x.dtype:
        _fail(op, f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.shape[1] != x.shape[-1]:
        _fail(op, f"weight must be [N, K] with K = x's last dimension ({x.shape[-1]}), got {tuple(weight.shape)}")
    _last_dim_contiguous(op, "weight", weight)
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        _rank(op, "bias", bias, 1, "[N]")
        if bias.shape[0] != weight.shape[0] or bias.dtype != x.dtype:
            _fail(op, f"bias must be {x.dtype} [N] = ({weight.shape[0]},), got {bias.dtype} {tuple(bias.shape)}")
        tensors["bias"] = bias
    _same_device(op, **tensors)


def check_fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None, eps: float,
                       residual: Tensor | None, swiglu: bool, weight_scale: Tensor | None = None) -> None:
    op = "fused_linear"
    if not isinstance(x, Tensor) or x.dim() < 1:
        _fail(op, f"x must be a Tensor [..., K], got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in _FLOATS:
        _fail(op, f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    _rank(op, "weight", weight, 2, "[N, K]")
    K, N = x.shape[-1], weight.shape[0]
    if weight_scale is None and weight.dtype != x.dtype:
        _fail(op, f"weight must have x's dtype {x.dtype} (or be float8_e4m3fn with a weight_scale), got "
                  f"{weight.dtype}")
    if weight_scale is not None:
        if weight.dtype != torch.float8_e4m3fn:
            _fail(op, f"weight must be float8_e4m3fn when weight_scale is given, got {weight.dtype}")
        _rank(op, "weight_scale", weight_scale, 1, f"[{N}]")
        if weight_scale.shape[0] != N or weight_scale.dtype != torch.float32:
            _fail(op, f"weight_scale must be float32 [{N}] (one scale per weight row), got {weight_scale.dtype} "
                      f"{tuple(weight_scale.shape)}")
    if weight.shape[1] != K:
        _fail(op, f"weight must be [N, K] with K = x's last dimension ({K}), got {tuple(weight.shape)}")
    _last_dim_contiguous(op, "weight", weight)
    if swiglu and N % 2:
        _fail(op, f"swiglu needs weight = [gate; up] with an even row count N = 2 I, got N = {N}")
    tensors = {"x": x, "weight": weight}
    for name, t, size in (("bias", bias, N), ("norm_weight", norm_weight, K)):
        if t is None:
            continue
        _rank(op, name, t, 1, f"[{size}]")
        if t.shape[0] != size or t.dtype != x.dtype:
            _fail(op, f"{name} must be {x.dtype} [{size}], got {t.dtype} {tuple(t.shape)}")
        tensors[name] = t
    if norm_weight is not None and (not (eps >= 0.0) or eps == float("inf")):
        _fail(op, f"eps must be a finite float >= 0, got {eps}")
    if residual is not None:
        want = (*x.shape[:-1], N // 2 if swiglu else N)
        if not isinstance(residual, Tensor) or tuple(residual.shape) != want or residual.dtype != x.dtype:
            got = (f"{residual.dtype} {tuple(residual.shape)}" if isinstance(residual, Tensor)
                   else type(residual).__name__)
            _fail(op, f"residual must be {x.dtype} {want} (x's rows by the output width), got {got}")
        _last_dim_contiguous(op, "residual", residual)
        tensors["residual"] = residual
    if weight_scale is not None:
        tensors["weight_scale"] = weight_scale
    _same_device(op, **tensors)


def check_rms_norm(x: Tensor, weight: Tensor, eps: float) -> None:
    op = "rms_norm"
    if not isinstance(x, Tensor) or x.dim() < 1:
        _fail(op, f"x must be a Tensor [..., H], got {getattr(x, 'shape', type(x).__name__)}")
    _rank(op, "weight", weight, 1, "[H]")
    if x.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        _fail(op, f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if weight.shape[0] != x.shape[-1]:
        _fail(op, f"weight must be [H] with H = x's last dimension ({x.shape[-1]}), got {tuple(weight.shape)}")
    if not (eps >= 0.0) or eps == float("inf"):
        _fail(op, f"eps must be a finite float >= 0, got {eps}")
    _same_device(op, x=x, weight=weight)


def check_lookup(tokens: Tensor, seqlens: Tensor, depth: int, min_ngram: int, max_ngram: int) -> None:
    op = "prompt_lookup_chain"
    _rank(op, "tokens", tokens, 2, "[B, C]")
    if tokens.dtype != torch.int64:
        _fail(op, f"tokens must be int64, got {tokens.dtype}")
    if not isinstance(seqlens, Tensor) or seqlens.dtype not in _INTS:
        got = getattr(seqlens, "dtype", type(seqlens).__name__)
        _fail(op, f"seqlens must be an int32 (or int64) Tensor, got {got}")
    if tuple(seqlens.shape) != (tokens.shape[0],):
        _fail(op, f"seqlens must have shape [B] = ({tokens.shape[0]},), got {tuple(seqlens.shape)}")
    if tokens.shape[1] < 1:
        _fail(op, "tokens must hold at least the root (C >= 1), got C = 0")
    if depth < 1:
        _fail(op, f"depth must be >= 1, got {depth}")
    if not 1 <= min_ngram <= max_ngram:
        _fail(op, f"need 1 <= min_ngram <= max_ngram, got min_ngram {min_ngram}, max_ngram {max_ngram}")
    _same_device(op, tokens=tokens, seqlens=seqlens)


def check_lookup_values(tokens: Tensor, seqlens: Tensor) -> None:
    """Every root column must lie in tokens' row. Syncs a CUDA device; skipped under capture or tracing."""
    C = tokens.shape[1]
    check_lengths("prompt_lookup_chain", "seqlens", seqlens, C - 1, why=f"the root's column: tokens has {C} columns")


def check_record(proposed, accepted, realised, mass, seen, keys, within, contained, accept_index, accept_len,
                 active, decay: float, rate: float) -> None:
    op = "record_acceptance_"
    for name, t, dtype in (("proposed", proposed, torch.float32), ("accepted", accepted, torch.float32),
                           ("realised", realised, torch.float32), ("mass", mass, torch.float32),
                           ("seen", seen, torch.bool), ("contained", contained, torch.bool)):
        _rank(op, name, t, 1, "[cells]" if name in ("proposed", "accepted") else "[K]")
        if t.dtype != dtype:
            _fail(op, f"{name} must be {dtype}, got {t.dtype}")
        if name != "contained" and not t.is_contiguous():
            _fail(op, f"{name} must be contiguous (it is updated in place), got strides {tuple(t.stride())}")
    if accepted.shape != proposed.shape:
        _fail(op, f"accepted must have proposed's shape {tuple(proposed.shape)}, got {tuple(accepted.shape)}")
    K = realised.shape[0]
    for name, t in (("mass", mass), ("seen", seen), ("contained", contained)):
        if t.shape[0] != K:
            _fail(op, f"{name} must have realised's shape [K] = ({K},), got {tuple(t.shape)}")
    _rank(op, "keys", keys, 2, "[B, T]")
    B, T = keys.shape
    _rank(op, "within", within, 3, "[B, T, K]")
    _rank(op, "accept_index", accept_index, 2, "[B, A]")
    for name, t, want in (("keys", keys, (B, T)), ("within", within, (B, T, K)),
                          ("accept_index", accept_index, (B, accept_index.shape[1])),
                          ("accept_len", accept_len, (B,)), ("active", active, (B,))):
        if tuple(t.shape) != want:
            _fail(op, f"{name} must have shape {list(want)}, got {tuple(t.shape)}")
    for name, t, dtype in (("keys", keys, torch.int64), ("within", within, torch.float32),
                           ("accept_index", accept_index, torch.int64), ("accept_len", accept_len, torch.int64),
                           ("active", active, torch.bool)):
        if t.dtype != dtype:
            _fail(op, f"{name} must be {dtype}, got {t.dtype}")
    if not (0.0 < decay <= 1.0) or not (0.0 < rate <= 1.0):
        _fail(op, f"decay and rate must lie in (0, 1], got decay {decay}, rate {rate}")
    _same_device(op, proposed=proposed, accepted=accepted, realised=realised, mass=mass, seen=seen, keys=keys,
                 within=within, contained=contained, accept_index=accept_index, accept_len=accept_len, active=active)


def check_record_values(proposed: Tensor, keys: Tensor, accept_index: Tensor, accept_len: Tensor) -> None:
    """Cells inside the tables, paths inside the tree. Syncs a CUDA device; skipped under capture or tracing."""
    op = "record_acceptance_"
    check_lengths(op, "keys", keys, proposed.shape[0] - 1, why="the statistics cells")
    check_lengths(op, "accept_len", accept_len, accept_index.shape[1], low=1, why="the accepted path's columns")
    check_lengths(op, "accept_index", accept_index, keys.shape[1] - 1, why="the verified nodes")


def check_invariant_attn(q, k_cache, v_cache, cache_seqlens, ancestors, depths, scale) -> None:
    op = "invariant_attn"
    _qkv(op, q, "k_cache", k_cache, "v_cache", v_cache, "[B, N, Hkv, D]")
    _lengths(op, "cache_seqlens", cache_seqlens, q, allow_per_query=False)
    B, M = q.shape[0], q.shape[1]
    if not isinstance(ancestors, Tensor) or ancestors.dtype not in _INTS:
        _fail(op, f"ancestors must be an int32 Tensor [B, M, A], got {getattr(ancestors, 'dtype', type(ancestors).__name__)}")
    if ancestors.dim() != 3 or tuple(ancestors.shape[:2]) != (B, M) or ancestors.shape[2] < 1:
        _fail(op, f"ancestors must have shape [B, M, A] = ({B}, {M}, A >= 1), got {tuple(ancestors.shape)}")
    if not isinstance(depths, Tensor) or depths.dtype not in _INTS or tuple(depths.shape) != (B, M):
        _fail(op, f"depths must be int32 [B, M] = ({B}, {M}), got "
                  f"{getattr(depths, 'dtype', type(depths).__name__)} {tuple(getattr(depths, 'shape', ()))}")
    _scale(op, scale)
    _same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, ancestors=ancestors,
                 depths=depths)


def check_invariant_attn_values(k_cache: Tensor, cache_seqlens: Tensor, ancestors: Tensor, depths: Tensor) -> None:
    """Every depth within ``[0, A)`` and every query's last key row ``cache_seqlens + ancestors[.., depth]`` inside
    the cache. Skipped under capture or tracing."""
    op = "invariant_attn"
    if depths.numel() == 0 or not _values_readable(cache_seqlens, ancestors, depths):
        return
    check_lengths(op, "cache_seqlens", cache_seqlens, k_cache.shape[1])
    check_lengths(op, "depths", depths, ancestors.shape[2] - 1)
    seen = torch.arange(ancestors.shape[2], device=depths.device)[None, None, :] <= depths.to(torch.int64)[..., None]
    anc = torch.where(seen, ancestors.to(torch.int64), 0)
    if int(anc.min()) < 0:
        _fail(op, "ancestors values must be >= 0")
    reach = int((cache_seqlens.to(torch.int64)[:, None, None] + anc).max())
    if reach > k_cache.shape[1] - 1:
        _fail(op, f"cache_seqlens + ancestors reaches row {reach}, beyond the cache's {k_cache.shape[1]} rows")


def check_beam(logits: Tensor, cum_logp: Tensor, width: int) -> None:
    op = "beam_topk"
    _rank(op, "logits", logits, 3, "[B, P, V]")
    if logits.dtype not in _FLOATS:
        _fail(op, f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    B, P, V = logits.shape
    if P < 1 or V < 1:
        _fail(op, f"logits must hold at least one parent and one column, got shape {tuple(logits.shape)}")
    if not isinstance(cum_logp, Tensor) or cum_logp.dtype != torch.float32 or tuple(cum_logp.shape) != (B, P):
        _fail(op, f"cum_logp must be float32 [B, P] = ({B}, {P}), got "
                  f"{getattr(cum_logp, 'dtype', type(cum_logp).__name__)} {tuple(getattr(cum_logp, 'shape', ()))}")
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= P * V:
        _fail(op, f"width must be an int in [1, P * V] = [1, {P * V}], got {width!r}")
    if P * V >= 1 << 32:
        _fail(op, f"P * V must be below 2^32 (the kernel's index keys), got {P * V}")
    _same_device(op, logits=logits, cum_logp=cum_logp)
