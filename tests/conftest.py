"""Shared test configuration: the CUDA marker, and the Triton interpreter on machines without a GPU."""
from __future__ import annotations

import os

# Must happen before triton is first imported: without a GPU, Triton kernels run in its interpreter on CPU tensors.
# (torch.cuda.is_available() does not import triton.)
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from longspec.testing import skip_cuda_tests_without_a_gpu  # noqa: E402

requires_cuda = pytest.mark.requires_cuda


def pytest_collection_modifyitems(config, items):
    skip_cuda_tests_without_a_gpu(items)
