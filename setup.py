"""Build script: the optional C++/CUDA extension ``longspec_ops._C``.

Knobs (echoed at build time):
  LONGSPEC_BUILD_EXT=auto|0|1   auto (default): build when torch is importable, is a CUDA build and a CUDA toolkit
                                exists; 0: pure-Python install; 1: build or fail.
  LONGSPEC_CUDA_ARCHS           semicolon list of compute capabilities, default "8.0;9.0" (+PTX of the last).
  MAX_JOBS, NVCC_THREADS, DEBUG=1

The extension targets the LibTorch stable ABI with a torch 2.11 floor and the Python limited API (abi3, >= 3.10),
so one build loads on torch 2.11-2.14 and every CPython >= 3.10. Build it with
``pip install --no-build-isolation -e .`` in an environment that already has torch.
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

MODE = os.environ.get("LONGSPEC_BUILD_EXT", "auto").strip().lower()
if MODE not in ("auto", "0", "1"):
    sys.exit(f"LONGSPEC_BUILD_EXT must be auto, 0 or 1, got {MODE!r}")
HERE = os.path.dirname(os.path.abspath(__file__))


def _log(msg: str) -> None:
    print(f"[longspec build] {msg}", file=sys.stderr, flush=True)


def _ext_reason() -> tuple[bool, str]:
    if MODE == "0":
        return False, "LONGSPEC_BUILD_EXT=0"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError as e:
        return False, f"torch is not importable in the build environment ({e}; use --no-build-isolation)"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is not a CUDA build"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), toolkit at {CUDA_HOME}"


def _extensions():
    build, why = _ext_reason()
    _log(f"LONGSPEC_BUILD_EXT={MODE}: {'building' if build else 'not building'} longspec_ops._C ({why})")
    if not build:
        if MODE == "1":
            sys.exit(f"LONGSPEC_BUILD_EXT=1 but the extension cannot be built: {why}")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    archs = os.environ.get("LONGSPEC_CUDA_ARCHS", "8.0;9.0").replace(",", ";").split(";")
    archs = [a.strip() for a in archs if a.strip()]
    gencode = []
    for a in archs:
        num = a.replace(".", "")
        gencode.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    last = archs[-1].replace(".", "")
    gencode.append(f"-gencode=arch=compute_{last},code=compute_{last}")  # PTX for newer GPUs
    _log(f"CUDA archs: {archs} (+PTX {last})")
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    defines = ["-DTORCH_TARGET_VERSION=0x020b000000000000", "-DPy_LIMITED_API=0x030A0000"]
    nvcc = opt + defines + gencode + ["-DUSE_CUDA", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    threads = os.environ.get("NVCC_THREADS")
    if threads:
        nvcc.append(f"--threads={threads}")
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "*.cu")))
    ext = CUDAExtension(
        name="longspec_ops._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": opt + defines + ["-std=c++17"], "nvcc": nvcc},
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
