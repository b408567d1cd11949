// Registers the CUDA kernels of `longspec::merge_attn_states` and `longspec::commit_kv_`, and defines the
// empty Python module `longspec_ops._C` whose import runs these registrations.
//
// The schemas are defined once, in Python (longspec_ops/_library.py imports before _C), so this file only
// adds CUDA implementations: STABLE_TORCH_LIBRARY_IMPL, never STABLE_TORCH_LIBRARY. TORCH_BOX turns the
// unboxed C++ functions into the stable ABI's boxed calling convention.
//
// Python.h comes first, as CPython requires. Py_LIMITED_API (set by setup.py) restricts this file to the
// abi3 API, so the same .so imports on every CPython >= 3.10.
#include <Python.h>

#include "ops.h"

#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY_IMPL(longspec, CUDA, m) {
  // Internal names: the public ops (longspec_ops/_library.py) check arguments in Python, then call these.
  m.impl("_merge_attn_states_kernel", TORCH_BOX(&longspec::merge_attn_states_cuda));
  m.impl("_commit_kv_kernel", TORCH_BOX(&longspec::commit_kv_cuda));
}

// The module itself carries nothing: importing it loads the shared library, whose static initialisers above
// register the kernels with the dispatcher (the extension-cpp pattern for stable-ABI extensions).
extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C", // m_name
      "CUDA kernels of longspec_ops, registered with torch.ops.longspec on import.", // m_doc
      -1, // m_size: no per-interpreter state
      nullptr, // m_methods
      nullptr, // m_slots
      nullptr, // m_traverse
      nullptr, // m_clear
      nullptr, // m_free
  };
  return PyModule_Create(&module_def);
}
}
