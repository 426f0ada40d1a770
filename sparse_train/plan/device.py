"""Device probes: what the Triton and Gluon kernels can use on a device (Triton outside the interpreter, TMA
tensor descriptors, the Hopper Gluon kernels) and how many programs it runs at once. Read by the tile tables
(:mod:`sparse_train.plan.tuning`) and by the dispatchers that choose between a kernel and its PyTorch path."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..kernels import triton_kernels

__all__ = [
    "copy_engine_loads",
    "device_sm_count",
    "gluon_kernels",
    "tma_addressable",
    "triton_runs_eagerly_on",
    "triton_runs_on",
]

_HOST_CORES = os.cpu_count() or 1  # read once: torch.compile cannot trace os.cpu_count


def triton_runs_on(tensor: Tensor) -> bool:
    """Whether the Triton kernels can run on ``tensor``'s device outside the interpreter: a CUDA tensor, with
    Triton importable. The selector's top-k, canonical-merge and draw kernels ask this, and the token selector's
    kernels (un-rotation, index queries, index scores, candidate bounds and scores, token-level KL: custom ops, so
    a compiled graph runs them too); the attention and pooling kernels ask ``functional.choose_backend``, which
    also checks dtype, head dim and block sizes."""
    if tensor.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # missing or broken on this machine: the PyTorch paths
        return False
    return True


def triton_runs_eagerly_on(tensor: Tensor) -> bool:
    """:func:`triton_runs_on` outside a torch.compile trace: the kernel paths that a compiled graph leaves to the
    PyTorch references (inductor fuses their ops itself): the pooled scorer's block logits
    (``kernels/triton/scores.py``)."""
    return not torch.compiler.is_compiling() and triton_runs_on(tensor)


def copy_engine_loads(device) -> bool:
    """Whether the attention kernels can load tiles through TMA tensor descriptors on ``device``: a CUDA
    device of compute capability 9 (Hopper) or newer, or the CPU, where the Triton interpreter of the tests
    emulates them. ``kernels.triton._launch.tma_descriptor`` adds the per-tensor layout rules."""
    device = torch.device(device)
    if device.type == "cuda":
        # get_device_properties, not get_device_capability: torch.compile folds it into a constant while it
        # traces the schedule of a compiled attention call
        return torch.cuda.get_device_properties(device).major >= 9
    return device.type == "cpu"


def gluon_kernels(device) -> bool:
    """Whether the hand-scheduled Gluon kernels can run on ``device``: a Hopper GPU (compute capability
    9; its warpgroup MMAs and TMA) and a triton that has Gluon."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_properties(device).major != 9:
        return False
    return triton_kernels().HAS_GLUON


def device_sm_count(device) -> int:
    """Parallel processors of ``device``: the streaming multiprocessors of a CUDA device; the CPU
    cores elsewhere (the Triton interpreter runs programs on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _HOST_CORES


def tma_addressable(x: Tensor) -> bool:
    """Whether the copy engine can address ``x`` through a tensor descriptor: the last stride 1, the base and
    every other stride multiples of 16 bytes, a row of at least 16 bytes."""
    size = x.element_size()
    return not (
        x.stride(-1) != 1
        or x.data_ptr() % 16
        or x.shape[-1] * size < 16
        or any(stride <= 0 or stride * size % 16 for stride in x.stride()[:-1])
    )
