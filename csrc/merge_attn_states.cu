// merge_attn_states: exact softmax merge of two partial attentions over disjoint key sets (LongSpec's hybrid
// tree attention merges the prefix part and the tree part this way; flash-attn / FlashInfer do the same for
// split-KV decoding).
//
//   lse = logaddexp(lse_a, lse_b)
//   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
//
// out_* [B, M, H, D] with any strides but a contiguous last dim; lse_* float32 [B, H, M], any strides.
// Results: out [B, M, H, D] contiguous in out_a's dtype, lse float32 [B, H, M] contiguous.
//
// One "row" is one (b, m, h): D output values sharing one pair of weights. A block of 256 threads is a 2-D
// tile of `lanes` threads per row (the row's 16-byte chunks rounded up to a power of two, at most 32) by
// 256 / lanes rows, striding over the rows. Each thread moves 16 bytes per load when every pointer and stride
// allows it, else one element. The op is purely memory-bound: what matters is coalesced wide loads and not
// launching one block per row.
#include "cuda_utils.cuh"
#include "ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace longspec {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxLanes = 32; // threads per row; longer rows loop, shorter rows pack more rows per block

struct MergeParams {
  const void* out_a;
  const void* out_b;
  const float* lse_a;
  const float* lse_b;
  void* out;
  float* lse;
  int64_t M, H, D, rows;
  // strides in elements: out_* over (b, m, h); lse_* over (b, h, m)
  int64_t oa_sb, oa_sm, oa_sh;
  int64_t ob_sb, ob_sm, ob_sh;
  int64_t la_sb, la_sh, la_sm;
  int64_t lb_sb, lb_sh, lb_sm;
};

// fp32 math for the 16-bit types and fp32 (as the reference does); fp64 stays fp64.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_acc(typename Acc<T>::type x);
template <>
__device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <>
__device__ __forceinline__ double from_acc<double>(double x) { return x; }
// Round to nearest even, as Tensor.to(float16 / bfloat16) does in the reference.
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Explicit float / double overloads so fp32 math never silently widens to fp64 (or the reverse).
__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log1p_(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p_(double x) { return log1p(x); }
__device__ __forceinline__ float abs_(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_(double x) { return fabs(x); }
template <typename A>
__device__ __forceinline__ bool is_inf(A x) {
  return abs_(x) == A(INFINITY);
}

// logaddexp with torch's formulation: max + log1p(exp(-|a - b|)), and a == b == +-inf returned as is so
// that two empty sides (both -inf) give -inf instead of NaN from (-inf) - (-inf).
template <typename A>
__device__ __forceinline__ A logaddexp(A a, A b) {
  if (is_inf(a) && a == b) {
    return a;
  }
  const A m = a > b ? a : b;
  return m + log1p_(exp_(-abs_(a - b)));
}

// VEC elements travel together: VEC * sizeof(T) == 16 bytes on the vectorised path, 1 element otherwise.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreadsPerBlock)
    merge_attn_states_kernel(const MergeParams p) {
  using A = typename Acc<T>::type;
  using P = Pack<T, VEC>;
  const int64_t chunks = p.D / VEC; // host guarantees D % VEC == 0
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; row < p.rows;
       row += row_step) {
    const int64_t h = row % p.H;
    const int64_t m = (row / p.H) % p.M;
    const int64_t b = row / (p.H * p.M);

    const A la = static_cast<A>(p.lse_a[b * p.la_sb + h * p.la_sh + m * p.la_sm]);
    const A lb = static_cast<A>(p.lse_b[b * p.lb_sb + h * p.lb_sh + m * p.lb_sm]);
    const A lse = logaddexp(la, lb);
    // The reference's guard: with lse = -inf (both sides empty) the weights become exp(-inf - 0) = 0,
    // so out is exactly 0 rather than NaN; a single empty side gets weight exp(-inf) = 0 the same way.
    const A safe = is_inf(lse) ? A(0) : lse;
    const A wa = exp_(la - safe);
    const A wb = exp_(lb - safe);
    if (threadIdx.x == 0) {
      p.lse[(b * p.H + h) * p.M + m] = static_cast<float>(lse);
    }

    const T* a_row = static_cast<const T*>(p.out_a) + b * p.oa_sb + m * p.oa_sm + h * p.oa_sh;
    const T* b_row = static_cast<const T*>(p.out_b) + b * p.ob_sb + m * p.ob_sm + h * p.ob_sh;
    T* o_row = static_cast<T*>(p.out) + row * p.D; // out is contiguous [B, M, H, D]: row-major over (b, m, h)
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const P va = reinterpret_cast<const P*>(a_row)[c];
      const P vb = reinterpret_cast<const P*>(b_row)[c];
      P vo;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        vo.v[i] = from_acc<T>(to_acc(va.v[i]) * wa + to_acc(vb.v[i]) * wb);
      }
      reinterpret_cast<P*>(o_row)[c] = vo;
    }
  }
}

int next_pow2(int64_t x) {
  int r = 1;
  while (r < x && r < kMaxLanes) {
    r <<= 1;
  }
  return r;
}

// A dimension of size 1 is never stepped over, so its stride does not affect alignment.
bool stride_ok(int64_t stride, int64_t size, int64_t vec) {
  return size == 1 || stride % vec == 0;
}

template <typename T>
void launch_merge(const MergeParams& p, bool can_vectorise, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t vec = can_vectorise ? kVec : 1;
  const int lanes = next_pow2(std::max<int64_t>(p.D / vec, 1));
  const int rows_per_block = kThreadsPerBlock / lanes;
  const int64_t blocks = std::min<int64_t>((p.rows + rows_per_block - 1) / rows_per_block, INT_MAX);
  const dim3 block(lanes, rows_per_block);
  if (can_vectorise) {
    merge_attn_states_kernel<T, kVec><<<static_cast<unsigned>(blocks), block, 0, stream>>>(p);
  } else {
    merge_attn_states_kernel<T, 1><<<static_cast<unsigned>(blocks), block, 0, stream>>>(p);
  }
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

std::tuple<torch::stable::Tensor, torch::stable::Tensor> merge_attn_states_cuda(
    const torch::stable::Tensor& out_a,
    const torch::stable::Tensor& lse_a,
    const torch::stable::Tensor& out_b,
    const torch::stable::Tensor& lse_b) {
  constexpr const char* op = "merge_attn_states";
  STD_TORCH_CHECK(out_a.is_cuda(), "longspec.merge_attn_states: out_a must be a CUDA tensor");
  const int32_t dev = out_a.get_device_index();
  check_on_device(op, "lse_a", lse_a, dev);
  check_on_device(op, "out_b", out_b, dev);
  check_on_device(op, "lse_b", lse_b, dev);

  STD_TORCH_CHECK(out_a.dim() == 4, "longspec.merge_attn_states: out_a must be 4-D [B, M, H, D], got shape ",
                  shape_str(out_a));
  const int64_t B = out_a.size(0), M = out_a.size(1), H = out_a.size(2), D = out_a.size(3);
  const ScalarType dtype = out_a.scalar_type();
  STD_TORCH_CHECK(dtype == ScalarType::Half || dtype == ScalarType::BFloat16 || dtype == ScalarType::Float ||
                      dtype == ScalarType::Double,
                  "longspec.merge_attn_states: out_a must be float16, bfloat16, float32 or float64, got ",
                  dtype_name(dtype));
  STD_TORCH_CHECK(out_b.dim() == 4 && out_b.size(0) == B && out_b.size(1) == M && out_b.size(2) == H &&
                      out_b.size(3) == D,
                  "longspec.merge_attn_states: out_b must have out_a's shape ", shape_str(out_a), ", got ",
                  shape_str(out_b));
  STD_TORCH_CHECK(out_b.scalar_type() == dtype, "longspec.merge_attn_states: out_b must have out_a's dtype ",
                  dtype_name(dtype), ", got ", dtype_name(out_b.scalar_type()));
  STD_TORCH_CHECK(D <= 1 || out_a.stride(3) == 1,
                  "longspec.merge_attn_states: out_a must have a contiguous last dimension (stride 1), got ",
                  out_a.stride(3));
  STD_TORCH_CHECK(D <= 1 || out_b.stride(3) == 1,
                  "longspec.merge_attn_states: out_b must have a contiguous last dimension (stride 1), got ",
                  out_b.stride(3));
  const torch::stable::Tensor* lses[2] = {&lse_a, &lse_b};
  const char* lse_names[2] = {"lse_a", "lse_b"};
  for (int i = 0; i < 2; ++i) {
    const torch::stable::Tensor& l = *lses[i];
    STD_TORCH_CHECK(l.dim() == 3 && l.size(0) == B && l.size(1) == H && l.size(2) == M,
                    "longspec.merge_attn_states: ", lse_names[i], " must have shape [B, H, M] = [", B, ", ", H,
                    ", ", M, "], got ", shape_str(l));
    STD_TORCH_CHECK(l.scalar_type() == ScalarType::Float, "longspec.merge_attn_states: ", lse_names[i],
                    " must be float32, got ", dtype_name(l.scalar_type()));
  }

  // Allocate on out_a's device (new_empty inherits it); out is contiguous whatever out_a's strides are.
  torch::stable::Tensor out = torch::stable::new_empty(out_a, {B, M, H, D});
  torch::stable::Tensor lse = torch::stable::new_empty(out_a, {B, H, M}, ScalarType::Float);
  const int64_t rows = B * M * H;
  if (rows == 0) {
    return std::make_tuple(out, lse);
  }

  MergeParams p{};
  p.out_a = out_a.const_data_ptr();
  p.out_b = out_b.const_data_ptr();
  p.lse_a = static_cast<const float*>(lse_a.const_data_ptr());
  p.lse_b = static_cast<const float*>(lse_b.const_data_ptr());
  p.out = out.mutable_data_ptr();
  p.lse = static_cast<float*>(lse.mutable_data_ptr());
  p.M = M;
  p.H = H;
  p.D = D;
  p.rows = rows;
  p.oa_sb = out_a.stride(0);
  p.oa_sm = out_a.stride(1);
  p.oa_sh = out_a.stride(2);
  p.ob_sb = out_b.stride(0);
  p.ob_sm = out_b.stride(1);
  p.ob_sh = out_b.stride(2);
  p.la_sb = lse_a.stride(0);
  p.la_sh = lse_a.stride(1);
  p.la_sm = lse_a.stride(2);
  p.lb_sb = lse_b.stride(0);
  p.lb_sh = lse_b.stride(1);
  p.lb_sm = lse_b.stride(2);

  // 16-byte loads need every row start 16-byte aligned: base pointers and the (b, m, h) strides of both
  // inputs (out is a fresh allocation, aligned whenever D is a multiple of the vector).
  const int64_t vec = 16 / static_cast<int64_t>(out_a.element_size());
  const bool can_vectorise = D % vec == 0 && is_aligned(p.out_a, 16) && is_aligned(p.out_b, 16) &&
                             is_aligned(p.out, 16) && stride_ok(p.oa_sb, B, vec) &&
                             stride_ok(p.oa_sm, M, vec) && stride_ok(p.oa_sh, H, vec) &&
                             stride_ok(p.ob_sb, B, vec) && stride_ok(p.ob_sm, M, vec) &&
                             stride_ok(p.ob_sh, H, vec);

  const torch::stable::accelerator::DeviceGuard guard(dev);
  const cudaStream_t stream = current_cuda_stream(dev);
  switch (dtype) {
    case ScalarType::Half:
      launch_merge<__half>(p, can_vectorise, stream);
      break;
    case ScalarType::BFloat16:
      launch_merge<__nv_bfloat16>(p, can_vectorise, stream);
      break;
    case ScalarType::Float:
      launch_merge<float>(p, can_vectorise, stream);
      break;
    case ScalarType::Double:
      launch_merge<double>(p, can_vectorise, stream);
      break;
    default:
      STD_TORCH_CHECK(false, "longspec.merge_attn_states: unsupported dtype ", dtype_name(dtype));
  }
  return std::make_tuple(out, lse);
}

} // namespace longspec
