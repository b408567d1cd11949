// Host entry points of the longspec CUDA kernels, shared by the .cu files that define them and bindings.cpp,
// which registers them for the CUDA dispatch key of the `longspec` library. The schemas are defined in Python
// (longspec_ops/_library.py); these signatures must match them argument for argument.
//
// Only LibTorch stable-ABI headers are allowed anywhere in csrc/: the build defines TORCH_TARGET_VERSION
// (a torch 2.11 floor), so one binary loads on every torch from 2.11 on.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <tuple>

namespace longspec {

// merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor out, Tensor lse)
//   out_a, out_b [B, M, H, D] (fp16/bf16/fp32/fp64, contiguous last dim); lse_a, lse_b float32 [B, H, M].
//   Returns out [B, M, H, D] (out_a's dtype, contiguous) and lse float32 [B, H, M] (contiguous).
std::tuple<torch::stable::Tensor, torch::stable::Tensor> merge_attn_states_cuda(
    const torch::stable::Tensor& out_a,
    const torch::stable::Tensor& lse_a,
    const torch::stable::Tensor& out_b,
    const torch::stable::Tensor& lse_b);

// commit_kv_(Tensor(a!) kv_cache, Tensor cache_seqlens, Tensor accept_index, Tensor accept_lens) -> ()
//   kv_cache contiguous [P, B, N, Hkv, D] (any dtype); cache_seqlens [B], accept_index [B, A], accept_lens [B]
//   (int32 or int64). In place: kv[p, b, s + j] = old kv[p, b, s + accept_index[b, j]] for j < accept_lens[b].
void commit_kv_cuda(
    const torch::stable::Tensor& kv_cache,
    const torch::stable::Tensor& cache_seqlens,
    const torch::stable::Tensor& accept_index,
    const torch::stable::Tensor& accept_lens);

} // namespace longspec
