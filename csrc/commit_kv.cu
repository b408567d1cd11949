// commit_kv_: after verification, move the accepted tree rows of every layer's K and V into their committed
// slots, in place, with ONE launch for all layers.
//
//   kv_cache [P, B, N, Hkv, D] contiguous (P = 2 x layers, one allocation); for every plane p, row b and
//   j < accept_lens[b]:  kv[p, b, s_b + j] = OLD kv[p, b, s_b + accept_index[b, j]],  s_b = cache_seqlens[b].
//
// Sources may overlap destinations (with accept_index = [0, 2, 5], row s+2 is the source of j = 1 and the
// destination of j = 2), so a destination may only be written once every source that lives in it has been
// read. Rows move only within one (p, b) and column c of a destination depends only on column c
// of its source, so a block owns one (p, b, column slice): it stages all A source slices in shared memory,
// synchronises, then writes. Blocks touch disjoint bytes, so no grid-wide ordering is needed, and the kernel
// never reads a value on the host: it is safe inside a captured CUDA graph.
//
// The copy is dtype-agnostic: rows are moved as raw 16/8/4/2/1-byte words, the widest the row size and the
// base pointer allow.
#include "cuda_utils.cuh"
#include "ops.h"

#include <cuda_runtime.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <climits>
#include <cstdint>

namespace longspec {
namespace {

constexpr int kThreads = 128;
// Staging budget per block (under the 48 KiB a kernel may use without opting in). The widest slice that fits
// A rows is used, capped so that small batches still spread over many SMs.
constexpr int64_t kStageBytes = 32 * 1024;
constexpr int64_t kMaxSliceBytes = 1024;
// Longest accepted path we stage: A rows x at least one 16-byte word, plus A row numbers, within 48 KiB.
constexpr int64_t kMaxAccept = 1024;

struct IndexRef {
  const void* ptr;
  int64_t stride0; // elements
  int64_t stride1; // elements (accept_index only)
  bool is64;
};

struct CommitParams {
  void* kv;
  int64_t B, N, A;
  int64_t row_words;   // words per cache row (Hkv * D * itemsize / word size)
  int64_t slice_words; // words per column slice owned by one block
  int64_t num_slices;
  IndexRef seqlens, index, lens;
};

// Index tensors may be int32 or int64; the branch is uniform across the block, so it costs nothing.
__device__ __forceinline__ int64_t load_index(const IndexRef& r, int64_t i, int64_t j) {
  const int64_t off = i * r.stride0 + j * r.stride1;
  return r.is64 ? static_cast<const int64_t*>(r.ptr)[off]
                 : static_cast<int64_t>(static_cast<const int32_t*>(r.ptr)[off]);
}

template <typename W>
__global__ void __launch_bounds__(kThreads) commit_kv_kernel(const CommitParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int64_t* src_row = reinterpret_cast<int64_t*>(smem_raw); // [A]: source row of j, or -1 to skip j
  // [A, slice_words] staged words; an even number of int64 slots keeps it 16-byte aligned for uint4.
  W* stage = reinterpret_cast<W*>(src_row + ((p.A + 1) & ~int64_t(1)));

  const int tid = static_cast<int>(threadIdx.x);
  const int nthreads = static_cast<int>(blockDim.x);
  const int64_t pb = blockIdx.x; // p * B + b: the (plane, batch) pair this block owns
  const int64_t b = pb % p.B;
  W* base = static_cast<W*>(p.kv) + pb * p.N * p.row_words;

  const int64_t s = load_index(p.seqlens, b, 0);
  // len <= A <= kMaxAccept and slices hold at most kMaxSliceBytes, so the per-block item counts below fit
  // in 32 bits (cheaper divisions than 64-bit ones).
  const int len = static_cast<int>(min(max(load_index(p.lens, b, 0), int64_t(0)), p.A));
  if (len == 0) {
    return; // uniform across the block, so no barrier below is left waiting
  }
  // Resolve each accepted row once. Out-of-range rows (bad lengths or indices) are skipped rather than
  // clamped, so a bad value can never touch memory outside this (p, b)'s N rows; src == dst needs no copy
  // (the root, and every prefix of the path that the tree already laid out in order).
  for (int j = tid; j < len; j += nthreads) {
    const int64_t dst = s + j;
    const int64_t src = s + load_index(p.index, b, j);
    const bool ok = dst >= 0 && dst < p.N && src >= 0 && src < p.N && src != dst;
    src_row[j] = ok ? src : -1;
  }
  __syncthreads();

  for (int64_t slice = blockIdx.y; slice < p.num_slices; slice += gridDim.y) {
    const int64_t c0 = slice * p.slice_words;
    const int width = static_cast<int>(min(p.slice_words, p.row_words - c0));
    const int items = len * width;
    // Phase 1: read every source slice before any destination is written (sources may be destinations).
    for (int i = tid; i < items; i += nthreads) {
      const int j = i / width;
      const int c = i - j * width;
      const int64_t src = src_row[j];
      if (src >= 0) {
        stage[j * p.slice_words + c] = base[src * p.row_words + c0 + c];
      }
    }
    __syncthreads();
    // Phase 2: write the destinations.
    for (int i = tid; i < items; i += nthreads) {
      const int j = i / width;
      const int c = i - j * width;
      if (src_row[j] >= 0) {
        base[(s + j) * p.row_words + c0 + c] = stage[j * p.slice_words + c];
      }
    }
    // The next slice reuses the stage.
    __syncthreads();
  }
}

template <typename W>
void launch_commit(CommitParams p, int64_t row_bytes, int64_t planes_x_batch, cudaStream_t stream) {
  const int64_t word = sizeof(W);
  p.row_words = row_bytes / word;
  const int64_t fit = std::max<int64_t>(kStageBytes / (p.A * word), 1);
  p.slice_words = std::min({p.row_words, fit, std::max<int64_t>(kMaxSliceBytes / word, 1)});
  p.num_slices = (p.row_words + p.slice_words - 1) / p.slice_words;
  const int64_t smem = ((p.A + 1) & ~int64_t(1)) * static_cast<int64_t>(sizeof(int64_t)) + p.A * p.slice_words * word;
  const dim3 grid(static_cast<unsigned>(planes_x_batch), static_cast<unsigned>(std::min<int64_t>(p.num_slices, 65535)));
  commit_kv_kernel<W><<<grid, kThreads, static_cast<size_t>(smem), stream>>>(p);
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}

IndexRef index_ref(const torch::stable::Tensor& t) {
  IndexRef r{};
  r.ptr = t.const_data_ptr();
  r.stride0 = t.stride(0);
  r.stride1 = t.dim() > 1 ? t.stride(1) : 0;
  r.is64 = t.scalar_type() == ScalarType::Long;
  return r;
}

} // namespace

void commit_kv_cuda(
    const torch::stable::Tensor& kv_cache,
    const torch::stable::Tensor& cache_seqlens,
    const torch::stable::Tensor& accept_index,
    const torch::stable::Tensor& accept_lens) {
  constexpr const char* op = "commit_kv_";
  STD_TORCH_CHECK(kv_cache.is_cuda(), "longspec.commit_kv_: kv_cache must be a CUDA tensor");
  const int32_t dev = kv_cache.get_device_index();
  check_on_device(op, "cache_seqlens", cache_seqlens, dev);
  check_on_device(op, "accept_index", accept_index, dev);
  check_on_device(op, "accept_lens", accept_lens, dev);

  STD_TORCH_CHECK(kv_cache.dim() == 5,
                  "longspec.commit_kv_: kv_cache must be 5-D [P, B, N, Hkv, D] (P = 2 x layers), got ",
                  shape_str(kv_cache));
  STD_TORCH_CHECK(kv_cache.is_contiguous(),
                  "longspec.commit_kv_: kv_cache must be contiguous (one preallocated tensor for all layers)");
  const int64_t P = kv_cache.size(0), B = kv_cache.size(1), N = kv_cache.size(2);
  const int64_t row_bytes = kv_cache.size(3) * kv_cache.size(4) * static_cast<int64_t>(kv_cache.element_size());

  STD_TORCH_CHECK(is_index_dtype(cache_seqlens.scalar_type()) && cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                  "longspec.commit_kv_: cache_seqlens must be int32 (or int64) [B] = [", B, "], got ",
                  dtype_name(cache_seqlens.scalar_type()), " ", shape_str(cache_seqlens));
  STD_TORCH_CHECK(is_index_dtype(accept_lens.scalar_type()) && accept_lens.dim() == 1 && accept_lens.size(0) == B,
                  "longspec.commit_kv_: accept_lens must be int32 (or int64) [B] = [", B, "], got ",
                  dtype_name(accept_lens.scalar_type()), " ", shape_str(accept_lens));
  STD_TORCH_CHECK(is_index_dtype(accept_index.scalar_type()) && accept_index.dim() == 2 && accept_index.size(0) == B,
                  "longspec.commit_kv_: accept_index must be int32 (or int64) [B, A] with B = ", B, ", got ",
                  dtype_name(accept_index.scalar_type()), " ", shape_str(accept_index));
  const int64_t A = accept_index.size(1);
  STD_TORCH_CHECK(A <= kMaxAccept, "longspec.commit_kv_: accept_index may have at most ", kMaxAccept,
                  " columns (accepted tokens per row), got ", A);
  STD_TORCH_CHECK(P * B <= INT_MAX, "longspec.commit_kv_: kv_cache has too many planes x rows (", P, " x ", B, ")");

  if (P == 0 || B == 0 || N == 0 || A == 0 || row_bytes == 0) {
    return;
  }

  CommitParams p{};
  p.kv = kv_cache.mutable_data_ptr();
  p.B = B;
  p.N = N;
  p.A = A;
  p.seqlens = index_ref(cache_seqlens);
  p.index = index_ref(accept_index);
  p.lens = index_ref(accept_lens);

  const torch::stable::accelerator::DeviceGuard guard(dev);
  const cudaStream_t stream = current_cuda_stream(dev);
  // Widest word that divides a row and matches the base pointer's alignment (a contiguous view with a
  // storage offset may start mid-word). Row starts are then aligned too, since rows are whole words apart.
  if (row_bytes % 16 == 0 && is_aligned(p.kv, 16)) {
    launch_commit<uint4>(p, row_bytes, P * B, stream);
  } else if (row_bytes % 8 == 0 && is_aligned(p.kv, 8)) {
    launch_commit<uint2>(p, row_bytes, P * B, stream);
  } else if (row_bytes % 4 == 0 && is_aligned(p.kv, 4)) {
    launch_commit<uint32_t>(p, row_bytes, P * B, stream);
  } else if (row_bytes % 2 == 0 && is_aligned(p.kv, 2)) {
    launch_commit<uint16_t>(p, row_bytes, P * B, stream);
  } else {
    launch_commit<uint8_t>(p, row_bytes, P * B, stream);
  }
}

} // namespace longspec
