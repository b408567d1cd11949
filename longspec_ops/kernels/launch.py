"""Launchers of the attention kernels: argument plumbing, TMA eligibility and the sm_90 dispatch.

``tree_attn``, ``prefix_attn`` and ``hybrid_tree_attn`` take already-validated arguments (``longspec_ops._checks``)
on one device and return ``(out [B, M, Hq, D] contiguous in q's dtype, lse float32 [B, Hq, M])``. Each is one split
launch of :mod:`.attention`'s kernel (or :mod:`.attention_sm90`'s on an H100/H200 for many packed rows) plus one
merge launch when the cache takes more than one split (:mod:`.configs`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..reference import attention as _ref
from .attention import _LOG2E, _merge_splits_kernel, _split_attn_kernel
from .configs import (AttnConfig, HybridBackend, _capability, _cdiv, _has_pdl, _next_pow2, _num_sms, merge_tile,
                      plan_splits, split_config, tree_config)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs must not silently drop to TF32 (10-bit mantissa): exact IEEE products, like the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def tma_eligible(cache: Tensor) -> bool:
    """Whether a ``[B, N, Hkv, D]`` cache can be read through a TMA descriptor: a 16-bit dtype (the tensor-core
    path), a 16-byte aligned base, 16-byte multiple strides and a contiguous last dim, on an sm_90+ GPU or in the
    Triton interpreter (which emulates descriptors, so the CPU tests run this path). Other caches use pointer loads.
    """
    if cache.dtype not in (torch.float16, torch.bfloat16):
        return False
    if cache.device.type == "cuda" and _capability(cache.device) < (9, 0):
        return False
    elt = cache.element_size()
    return (cache.data_ptr() % 16 == 0 and cache.stride(-1) == 1
            and all(st * elt % 16 == 0 for st in cache.stride()[:-1]))


def _attention(
    q: Tensor,
    cache: Optional[tuple[Tensor, Tensor, Tensor]],
    tree: Optional[tuple[Tensor, Tensor, Tensor]],
    scale: float,
    cfg: AttnConfig,
) -> tuple[Tensor, Tensor]:
    """One split launch (+ one merge launch when there is more than one split). ``cache`` = (k, v, lens),
    ``tree`` = (k, v, mask)."""
    B, M, Hq, D = q.shape
    Hkv = (cache if cache is not None else tree)[0].shape[2]
    G = Hq // Hkv
    R = M * G
    out = torch.empty((B, M, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, M), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse

    D_PAD = max(16, _next_pow2(D))
    row_tiles = _cdiv(R, cfg.block_m)
    N = cache[0].shape[1] if cache is not None else 0
    has_cache = cache is not None and N > 0  # an empty cache contributes nothing: skip its loads entirely
    n_cache, split_rows = 0, cfg.block_n
    if has_cache:
        slots = _num_sms(q.device) * cfg.occupancy
        n_cache, split_rows = plan_splits(N, B * Hkv * row_tiles, cfg.block_m, cfg.block_n, slots, cfg.split_rows,
                                          cfg.split_overhead_rows)
    num_splits = max(1, n_cache)  # the tree keys, if any, join the last split (the only split without a cache)
    direct = num_splits == 1

    # Unused pointer arguments get q (never dereferenced: their code is compiled out by the constexpr flags).
    k, v, lens = cache if has_cache else (q, q, q)
    kt, vt, mask = tree if tree is not None else (q, q, None)
    mask = mask.view(torch.uint8) if mask is not None else q  # bool -> uint8 view: no copy, no int64 masks
    lens_strides = (0, 0) if not has_cache else (lens.stride(0), lens.stride(1) if lens.dim() == 2 else 0)
    if direct:
        ws_o, ws_lse = out, lse  # unused
    else:
        ws_o = torch.empty((B * Hkv, num_splits, R, D), dtype=torch.float32, device=q.device)
        ws_lse = torch.empty((B * Hkv, num_splits, R), dtype=torch.float32, device=q.device)

    def s3(t):  # (batch, row, head) strides of a [B, S, H, D] tensor
        return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)

    tree_strides = (*s3(kt), *s3(vt),
                    *((mask.stride(0), mask.stride(1), mask.stride(2)) if tree is not None else (0, 0, 0)))
    pdl = cfg.pdl and not direct and _has_pdl(q.device)
    MK = kt.shape[1] if tree is not None else 0
    if cfg.wgmma and has_cache and (tree is None or MK == M) and _wgmma_applies(q, k, v, lens, D, num_splits):
        _launch_sm90(q, k, v, lens, kt, vt, mask, ws_o, ws_lse, (*s3(q), lens_strides[0], *tree_strides),
                     M, N, Hkv, R, G, D, split_rows, num_splits, scale, cfg, tree is not None)
    else:
        tree_block_n = min(cfg.block_n, max(16, _next_pow2(MK)))
        use_tma = cfg.tma and has_cache and tma_eligible(k) and tma_eligible(v)
        if use_tma:
            block = [1, cfg.block_n, 1, D_PAD]
            kd = TensorDescriptor(k, list(k.shape), list(k.stride()), block)
            vd = TensorDescriptor(v, list(v.shape), list(v.stride()), block)
        else:
            kd, vd = q, q  # unused
        _split_attn_kernel[(row_tiles, num_splits, B * Hkv)](
            q, k, v, kd, vd, lens, kt, vt, mask, out, lse, ws_o, ws_lse,
            *s3(q), *s3(k), *s3(v), *lens_strides, *tree_strides,
            M, N, Hkv, R, MK, split_rows, num_splits, scale * _LOG2E,
            D=D, D_PAD=D_PAD, G=G, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TREE_BLOCK_N=tree_block_n,
            HAS_CACHE=has_cache, HAS_TREE=tree is not None, DIRECT_OUT=direct,
            DOT_PRECISION=_dot_precision(q.dtype), USE_TMA=use_tma, PDL=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if not direct:
        block_s, block_r = merge_tile(num_splits, R, D_PAD)
        _merge_splits_kernel[(_cdiv(R, block_r), B * Hkv)](
            ws_o, ws_lse, out, lse, M, Hkv, R, num_splits,
            D=D, D_PAD=D_PAD, G=G, BLOCK_R=block_r, BLOCK_S=block_s, PDL=pdl,
            num_warps=cfg.merge_num_warps, launch_pdl=pdl,
        )
    return out, lse


def _wgmma_applies(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, D: int, num_splits: int) -> bool:
    """Whether the Gluon sm_90 kernel takes this launch (see ``AttnConfig.wgmma``)."""
    return (q.device.type == "cuda" and _capability(q.device) == (9, 0) and q.dtype in (torch.float16, torch.bfloat16)
            and k.dtype == q.dtype and v.dtype == q.dtype and D in (64, 128) and lens.dim() == 1
            and num_splits >= 2 and tma_eligible(k) and tma_eligible(v))


def _launch_sm90(q, k, v, lens, kt, vt, mask, ws_o, ws_lse, strides, M, N, Hkv, R, G, D, split_rows, num_splits,
                 scale, cfg, has_tree):
    """The Gluon kernel's launch; ``strides`` = q's (batch, row, head), lens', then the tree K/V and mask strides
    in ``_split_attn_sm90_kernel``'s argument order."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from . import attention_sm90

    block = [1, cfg.block_n, 1, D]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16 if q.dtype == torch.float16 else gl.bfloat16)
    kd = GluonTensorDescriptor(k, list(k.shape), list(k.stride()), block, layout)
    vd = GluonTensorDescriptor(v, list(v.shape), list(v.stride()), block, layout)
    attention_sm90._split_attn_sm90_kernel[(_cdiv(R, cfg.block_m), num_splits, q.shape[0] * Hkv)](
        q, kd, vd, lens, kt, vt, mask, ws_o, ws_lse, *strides,
        M, N, Hkv, R, split_rows, num_splits, scale * _LOG2E,
        D=D, G=G, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, HAS_TREE=has_tree,
        num_warps=cfg.num_warps,
    )


def _reference_result(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    return out.contiguous(), lse.contiguous()


def tree_attn(
    q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, scale: float, *, config: Optional[AttnConfig] = None
) -> tuple[Tensor, Tensor]:
    """Masked attention among the M tree tokens.

    q ``[B, M, Hq, D]``, k/v ``[B, K, Hkv, D]`` (any strides, stride(-1) == 1), tree_mask bool ``[B, M, K]``.
    Returns out ``[B, M, Hq, D]`` (contiguous, q's dtype) and lse float32 ``[B, Hq, M]``. ``config`` overrides
    the table default (:func:`tree_config`).
    """
    if q.dtype == torch.float64:  # a debugging dtype: the fp32-accumulating kernels would lose its precision
        return _reference_result(*_ref.tree_attn(q, k, v, tree_mask, scale))
    cfg = config or tree_config(q.shape[3], q.shape[1] * (q.shape[2] // k.shape[2]), q.dtype)
    return _attention(q, None, (k, v, tree_mask), scale, cfg)


def prefix_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor, scale: float, *,
    config: Optional[AttnConfig] = None,
) -> tuple[Tensor, Tensor]:
    """Split-KV attention of q ``[B, M, Hq, D]`` over cache rows ``[0, kv_lens)`` of k/v_cache ``[B, N, Hkv, D]``.

    kv_lens int32/int64 ``[B]`` or ``[B, M]``; values are clamped into ``[0, N]`` on the device. Returns out
    ``[B, M, Hq, D]`` (contiguous, q's dtype) and lse float32 ``[B, Hq, M]``. ``config`` overrides the table default
    (:func:`split_config`); its ``split_rows`` forces the split size.
    """
    if q.dtype == torch.float64:
        lens = kv_lens.clamp(0, k_cache.shape[1])
        return _reference_result(*_ref.prefix_attn(q, k_cache, v_cache, lens, scale))
    cfg = config or split_config(q.shape[3], q.shape[1] * (q.shape[2] // k_cache.shape[2]), q.dtype, q.device)
    return _attention(q, (k_cache, v_cache, kv_lens), None, scale, cfg)


def hybrid_tree_attn(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    tree_mask: Tensor,
    scale: float,
    *,
    backend: HybridBackend = HybridBackend.FUSED,
    config: Optional[AttnConfig] = None,
    tree_config_override: Optional[AttnConfig] = None,
) -> tuple[Tensor, Tensor]:
    """One softmax over cache rows ``[0, cache_seqlens[b])`` plus the tree keys each ``tree_mask`` row allows.

    q ``[B, M, Hq, D]``; k/v_cache ``[B, N, Hkv, D]``; cache_seqlens ``[B]``; k/v_tree ``[B, K, Hkv, D]``;
    tree_mask bool ``[B, M, K]``. Returns out ``[B, M, Hq, D]`` (contiguous, q's dtype), lse float32 ``[B, Hq, M]``.
    The Gluon sm_90 kernel takes only whole trees (K = M); a level of queries over more tree keys (a drafter's)
    runs the Triton kernel.

    ``backend=FUSED`` (default): the tree block joins the last split of the split-KV launch (two launches in all,
    one when the cache needs a single split).
    ``backend=COMPOSED``: prefix_attn, tree_attn and ``torch.ops.longspec.merge_attn_states``. ``config`` sets the
    split launch (FUSED, or the prefix launch of COMPOSED); ``tree_config_override`` the tree launch of COMPOSED.
    """
    if q.dtype == torch.float64:
        lens = cache_seqlens.clamp(0, k_cache.shape[1])
        return _reference_result(
            *_ref.hybrid_tree_attn(q, k_cache, v_cache, lens, k_tree, v_tree, tree_mask, scale))
    if backend is HybridBackend.COMPOSED:
        out_p, lse_p = prefix_attn(q, k_cache, v_cache, cache_seqlens, scale, config=config)
        out_t, lse_t = tree_attn(q, k_tree, v_tree, tree_mask, scale, config=tree_config_override)
        return torch.ops.longspec.merge_attn_states(out_p, lse_p, out_t, lse_t)
    if backend is not HybridBackend.FUSED:
        raise ValueError(f"hybrid_tree_attn: unknown backend {backend!r}")
    cfg = config or split_config(q.shape[3], q.shape[1] * (q.shape[2] // k_cache.shape[2]), q.dtype, q.device)
    return _attention(q, (k_cache, v_cache, cache_seqlens), (k_tree, v_tree, tree_mask), scale, cfg)


__all__ = [
    "AttnConfig",
    "HybridBackend",
    "hybrid_tree_attn",
    "plan_splits",
    "prefix_attn",
    "split_config",
    "tma_eligible",
    "tree_attn",
    "tree_config",
]
