// Helpers shared by the .cu launchers: the current CUDA stream through the stable C shim, and the argument
// checks every launcher repeats. CUDA-only (needs -DUSE_CUDA for the stream shim), so bindings.cpp never
// includes it.
#pragma once

#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

#include <cstdint>
#include <string>

namespace longspec {

using torch::headeronly::ScalarType;

// The stream PyTorch is currently using on `device_index`: kernels must run there so that they order
// correctly with surrounding torch ops and are captured by CUDA graphs. The shim hands back a borrowed
// cudaStream_t as void*.
inline cudaStream_t current_cuda_stream(int32_t device_index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

inline const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Half:
      return "float16";
    case ScalarType::BFloat16:
      return "bfloat16";
    case ScalarType::Float:
      return "float32";
    case ScalarType::Double:
      return "float64";
    case ScalarType::Int:
      return "int32";
    case ScalarType::Long:
      return "int64";
    case ScalarType::Bool:
      return "bool";
    default:
      return "another dtype";
  }
}

// Every tensor must live on the CUDA device of the first one: the kernels dereference all pointers there.
inline void check_on_device(
    const char* op,
    const char* name,
    const torch::stable::Tensor& t,
    int32_t device_index) {
  STD_TORCH_CHECK(
      t.is_cuda() && t.get_device_index() == device_index,
      "longspec.", op, ": ", name, " must be on the same CUDA device as the other arguments (cuda:",
      device_index, ")");
}

// "[2, 3, 4]": shapes in error messages, as the Python checks print them.
inline std::string shape_str(const torch::stable::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    s += (d ? ", " : "") + std::to_string(t.size(d));
  }
  return s + "]";
}

inline bool is_index_dtype(ScalarType t) {
  return t == ScalarType::Int || t == ScalarType::Long;
}

inline bool is_aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

} // namespace longspec
