"""Capturing a callable in a CUDA graph, as every graph of this project is taken (the benchmarks' replay timings,
the GPU capture tests). The attention and the selector capture when they read nothing back to the host
(``check_values=False``); README, "Use it directly"."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["capture_cuda_graph"]

T = TypeVar("T")


def capture_cuda_graph(fn: Callable[[], T], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` captured once in a new ``torch.cuda.CUDAGraph`` on the current device, after ``warmup`` calls on a
    side stream (the allocator and every lazy initialisation settle outside the capture, as
    ``torch.cuda.graphs`` asks). Returns the graph and what the captured call returned: tensors that each
    ``graph.replay()`` rewrites.

    A backward inside ``fn`` captures only if no autograd graph made outside the capture through the same leaf
    tensors is still alive (an output kept with ``retain_graph``, a loss not yet freed): that graph holds the
    leaves' gradient accumulators, made on the default stream, and the captured backward then waits on that
    stream, which invalidates the capture ("operation failed due to a previous error during capture" with
    torch 2.11). Drop such outputs first.

    Raises:
        ValueError: no CUDA device.
        torch.AcceleratorError (or RuntimeError): what the capture raises, e.g. for a host synchronisation
            inside ``fn``."""
    if not torch.cuda.is_available():
        raise ValueError("capture_cuda_graph needs a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output
