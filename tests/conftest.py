"""Test configuration. Without a CUDA device, Triton kernels run through the interpreter, which must be
switched on before any ``@triton.jit`` function is decorated, i.e. before sparse_train's kernel modules
are imported; conftest runs first, so this is the place."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
