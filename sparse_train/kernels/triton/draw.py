"""Triton kernel of the distillation's query-block draw: one Philox word per query block, in one launch.

Math, per query block i of a draw number t (an int64 on the device):
    word[i] = Philox4x32-10(key, counter = (i, t mod 2**32, t >> 32, 0)), first output word (uint32)
The caller keeps the ``count`` blocks with the smallest words (``selection.metrics.draw_query_blocks``).

Notation: NQB query blocks, ``key`` the 64-bit Philox key (``selection.metrics``' draw key), t the draw number.

Layers: (1) ``_draw_words_kernel``; (2) the launcher ``draw_words_launch``; no autograd; (4) the public function
``triton_draw_words``. The reference is ``kernels.reference.philox4x32_10`` (the same words, ~250 PyTorch ops
per draw: ten rounds of 32-bit products split into 16-bit halves); tests compare the two exactly.

Known limits: t in [0, 2**63); NQB < 2**32. The key is a compile-time constant (one fixed value in the
library): inductor (torch 2.11) could not take it as a 64-bit int argument ("'int' object has no attribute
'xreplace'"), and a constant costs no recompilation since the key never changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["draw_words_launch", "triton_draw_words"]

_BLOCKS_PER_PROGRAM = 1024


# ----------------------------------------------------------------------------------------------
# Layer 1: kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _draw_words_kernel(DRAW, OUT, NQB, KEY: tl.constexpr, BLOCK: tl.constexpr):
    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    draw = tl.load(DRAW).to(tl.int64)
    zeros = tl.zeros([BLOCK], tl.uint32)
    c0 = blocks.to(tl.uint32)
    c1 = zeros + (draw & 0xFFFFFFFF).to(tl.uint32)
    c2 = zeros + ((draw >> 32) & 0xFFFFFFFF).to(tl.uint32)
    word, _, _, _ = tl.philox(KEY, c0, c1, c2, zeros)
    tl.store(OUT + blocks, word.to(tl.int64) & 0xFFFFFFFF, mask=blocks < NQB)


# ----------------------------------------------------------------------------------------------
# Layer 2: launcher
# ----------------------------------------------------------------------------------------------
def draw_words_launch(num_q_blocks: int, draw: Tensor, key: int) -> Tensor:
    """int64 ``[NQB]`` words (uint32 values). No validation: ``draw`` a 1-element integer tensor, ``key`` an
    int in [0, 2**63)."""
    out = torch.empty(num_q_blocks, device=draw.device, dtype=torch.int64)
    if num_q_blocks:
        block = min(_BLOCKS_PER_PROGRAM, triton.next_power_of_2(num_q_blocks))
        _draw_words_kernel[(triton.cdiv(num_q_blocks, block),)](
            draw, out, num_q_blocks, KEY=key, BLOCK=block, num_warps=4
        )
    return out


# ----------------------------------------------------------------------------------------------
# Layer 4: public function (no autograd)
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def triton_draw_words(num_q_blocks: int, draw: Tensor, key: int) -> Tensor:
    """The Philox word of every query block for draw number ``draw``: what
    ``philox4x32_10(key, arange(NQB), draw, draw >> 32)[0]`` returns, in one kernel.

    Args:
        num_q_blocks: NQB >= 0.
        draw: integer tensor of one element on the kernel's device (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            value in [0, 2**63).
        key: the Philox key, an int in [0, 2**63).

    Returns:
        int64 ``[NQB]`` holding uint32 values.

    Raises:
        ValueError: ``draw`` not a one-element integer tensor; ``key`` out of range.
    """
    if not isinstance(draw, Tensor) or draw.numel() != 1 or draw.dtype.is_floating_point or draw.dtype == torch.bool:
        raise ValueError(
            f"draw must be an integer tensor of one element, got "
            f"{getattr(draw, 'dtype', type(draw).__name__)} {tuple(getattr(draw, 'shape', ()))}"
        )
    if not isinstance(key, int) or not 0 <= key < 2**63:
        raise ValueError(f"key must be an int in [0, 2**63), got {key!r}")
    return draw_words_launch(num_q_blocks, draw.reshape(1).to(torch.int64), key)
