"""What the Gluon kernels (Hopper, hand-scheduled: backward_gluon.py, forward_gluon.py) share: the Gluon imports,
the TMA descriptors of ``[B, H, N, D]`` tensors, the K/V ring load of a query-centric program, and the conditions
every Gluon kernel needs (the launchers run the Triton kernels outside them)."""
from __future__ import annotations

import torch

try:  # Gluon ships with triton >= 3.4; without it the Triton kernels are the only ones
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAS_GLUON = False

from ._launch import tma_addressable

__all__ = ["HAS_GLUON", "LOG2E", "gl", "gluon", "gluon_call_supported", "gluon_descriptor", "mbarrier", "tma",
           "warpgroup_mma", "warpgroup_mma_init", "warpgroup_mma_wait"]

LOG2E = 1.4426950408889634
"""log2(e) (the kernels' softmax runs in base 2), as a float the Gluon kernels and launchers both take."""


def gluon_descriptor(x, heads: int, rows: int):
    """A TMA descriptor of ``x`` ``[B, H, N, D]`` (any strides TMA addresses) for boxes of ``[1, heads, rows, D]``
    elements: ``heads`` consecutive heads' rows, which a kernel takes as a ``[heads * rows, D]`` tile; rows past
    N arrive as zeros."""
    block = [1, heads, rows, x.shape[-1]]
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def gluon_call_supported(q, k, v, do, *, block_q: int, block_k: int, has_seq_lens: bool, has_docs: bool,
                         dropout: bool, query_map: bool) -> str | None:
    """The conditions every Gluon kernel shares: None, or why this call is outside them (``do`` may be None:
    the forward)."""
    if not HAS_GLUON:
        return "this triton has no Gluon"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon kernels are for Hopper (sm_90)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16/fp16 only)"
    if has_seq_lens or has_docs or dropout or query_map:
        return "sequence lengths, documents, dropout or a query-block map"
    if block_k not in (64, 128):
        return f"BK={block_k} (64 or 128 supported)"
    if q.shape[2] % block_q:
        return f"N={q.shape[2]} is not a multiple of BLOCK_Q={block_q}"
    if not all(tma_addressable(x) for x in (q, k, v, do) if x is not None):
        return "a layout of q, k, v or dO that TMA cannot address"
    return None


if HAS_GLUON:
    @gluon.jit
    def issue_kv_load(desc_k, desc_v, k_ring, v_ring, ready, selected, stride_ik, b, hkv, t,
                      BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr):
        """Step t of a query-centric program: the K and V tiles of its t-th selected key block ([1, 1, BK, D]
        boxes, rows past N arrive as 0) land in ring slot t % NUM_BUF, signalled on ``ready[slot]``."""
        j = gl.load(selected + t * stride_ik)
        slot = t % NUM_BUF
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_k, [b, hkv, j * BLOCK_K, 0], bar, k_ring.index(slot))
        tma.async_copy_global_to_shared(desc_v, [b, hkv, j * BLOCK_K, 0], bar, v_ring.index(slot))
