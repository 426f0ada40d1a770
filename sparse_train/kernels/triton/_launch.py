"""Host-side helpers shared by the launchers of the kernels, and :func:`direct_call`, the eager bypass of their
``torch.library`` custom ops."""

from __future__ import annotations

import torch
from torch import Tensor

from ...plan.device import copy_engine_loads, tma_addressable

LAST_COMPILED: dict = {}
"""The last compiled kernel per launcher (``"fwd"``, ``"dq"``, ``"dkdv"``), for benchmarks that read
registers, spills or PTX; never used for compute."""


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def direct_call(*tensors: Tensor | None) -> bool:
    """Whether a public function may call its launchers directly instead of its ``torch.library`` custom op: not
    while torch.compile / export traces (they need the op and its fake), not under a TorchDispatchMode (selective
    activation checkpointing keeps an op's outputs by its name, ``sparse_train.module.checkpointing``; fake and
    functional tensors, flop counters), and only for plain tensors (no subclasses such as DTensor; None entries
    are skipped). A custom op's Python dispatch costs more host time per call than a launch; eagerly it buys
    nothing."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


def attention_output(q: Tensor) -> Tensor:
    """An uninitialised attention output for ``q`` ``[B, HQ, L, D]``: that shape as a view of ``[B, L, HQ, D]``
    memory, the layout of the ``[B, L, HQ * D]`` activations that feed the output projection, so that
    ``o.transpose(1, 2).reshape(B, L, HQ * D)`` is a view rather than a copy (and its gradient comes back
    without one). The kernels write it through its strides. The op's fake output uses the same function."""
    B, HQ, L, D = q.shape
    return q.new_empty((B, L, HQ, D)).transpose(1, 2)


def launch(kernel, grid, *args, num_warps: int, num_stages: int, **meta):
    """Launch a ``@triton.jit`` kernel; if the configuration exceeds shared memory on this GPU, retry
    with one pipeline stage less (same results: stages only change the prefetch depth)."""
    from triton.runtime.errors import OutOfResources

    while True:
        try:
            return kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **meta)
        except OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1


def kernel_seq_lens(seq_lens: Tensor | None, seq_len: int, fallback: Tensor) -> Tensor:
    """The SEQ_LENS argument of the kernels: int32, contiguous (the kernels index it as
    ``SEQ_LENS + b``, without a stride), values clamped to [0, N] on the device (no host sync: an
    unvalidated value, e.g. under torch.compile, can never widen a masked load past the end of K/V).
    ``fallback`` is the dummy pointer passed when there are no seq_lens."""
    if seq_lens is None:
        return fallback
    return seq_lens.to(torch.int64).clamp(0, seq_len).to(torch.int32).contiguous()


def kernel_document_ids(document_ids: Tensor | None, fallback: Tensor) -> Tensor:
    """The DOCS argument of the kernels: int32, contiguous ``[B, N]`` (the kernels index it as
    ``DOCS + b * N + t``, without strides). Ids are only compared, never used as addresses, so an
    unvalidated value can change a mask but never make a kernel read out of bounds. ``fallback`` is the
    dummy pointer passed when there are no document ids."""
    if document_ids is None:
        return fallback
    return document_ids.to(torch.int32).contiguous()


def kernel_query_map(query_map: Tensor | None, query_row0: Tensor | None, fallback: Tensor) -> tuple[Tensor, Tensor]:
    """The QUERY_MAP (int32 ``[NQL]``, local -> global query block) and QUERY_ROW0 (int64 ``[NQL]``, first
    row in q of each local block) arguments of the kernels, contiguous (indexed without strides);
    ``fallback`` for both when there is no map (the kernels then never read them)."""
    if query_map is None:
        return fallback, fallback
    return query_map.to(torch.int32).contiguous(), query_row0.to(torch.int64).contiguous()


def tma_descriptor(x: Tensor, rows: int, enabled: bool, block: list[int] | None = None):
    """A TMA tensor descriptor of ``x`` ``[B, H, L, D]`` for tiles of ``[1, 1, rows, D]`` elements (the kernels
    load ``desc.load([b, h, row, 0])`` and reshape to ``[rows, D]``; rows past L come back as zeros), or None
    when ``enabled`` is false or the copy engine cannot take ``x``: a GPU before Hopper, or a layout TMA
    does not address (the last stride 1, the base and every other stride multiples of 16 bytes, a row of at
    least 16 bytes). The kernels then take their pointer loads. On the CPU (the Triton interpreter of the
    tests) the descriptor is emulated, so the tests run the TMA branch of the kernels too. ``block``: another
    tile shape (as many dimensions as ``x``) instead of ``[1, 1, rows, D]``."""
    if not enabled or not copy_engine_loads(x.device) or not tma_addressable(x):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), block or [1, 1, rows, x.shape[-1]])


def tma_operands(a: Tensor, b: Tensor, rows: int, enabled: bool) -> tuple:
    """The kernel operands of two tensors a kernel loads tile by tile alike (K and V; q and dO): their TMA
    descriptors (:func:`tma_descriptor`) and True when both get one, else the tensors themselves and False,
    and the kernel takes its pointer loads for both."""
    desc_a = tma_descriptor(a, rows, enabled)
    desc_b = tma_descriptor(b, rows, desc_a is not None)
    if desc_b is None:
        return a, b, False
    return desc_a, desc_b, True


def kernel_valid_len(valid_len: Tensor | None, batch: int, device: torch.device) -> Tensor | None:
    """``valid_len`` (optional integer ``[B]`` on ``device``) as the kernels read it: int32, contiguous.

    Raises:
        ValueError: not an integer tensor of shape ``[B]`` on ``device``.
    """
    if valid_len is None:
        return None
    if (
        not isinstance(valid_len, Tensor)
        or valid_len.shape != (batch,)
        or valid_len.dtype.is_floating_point
        or valid_len.dtype == torch.bool
        or valid_len.device != device
    ):
        raise ValueError(
            f"valid_len must be an integer tensor [B] = [{batch}] on {device}, got "
            f"{getattr(valid_len, 'dtype', type(valid_len).__name__)} "
            f"{tuple(getattr(valid_len, 'shape', ()))} on {getattr(valid_len, 'device', None)}"
        )
    return valid_len.to(torch.int32).contiguous()


def position_strides(positions: Tensor | None) -> tuple[int, int]:
    """(batch stride, row stride) of RoPE ``positions`` ``[N]`` or ``[B, N]`` as the kernels read them (0 for an
    axis it lacks; both 0 without positions, which the kernels then take as the row numbers)."""
    if positions is None:
        return 0, 0
    if positions.dim() == 1:
        return 0, positions.stride(0)
    return positions.stride(0), positions.stride(1)
