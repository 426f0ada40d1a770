"""The draw kernel (kernels/triton/draw.py) against its PyTorch reference (kernels.reference.philox4x32_10): the same
Philox words, exactly; ``draw_query_blocks`` on the GPU picks what the PyTorch path picks."""

import pytest
import torch

from sparse_train.kernels.reference.attention import philox4x32_10
from sparse_train.kernels.triton.draw import triton_draw_words
from sparse_train.selection.metrics import _DRAW_KEY, draw_query_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")


@pytest.mark.parametrize("num_q_blocks", [1, 37, 1024, 2500], ids=["one", "odd-37", "1024", "three-programs-2500"])
@pytest.mark.parametrize("draw", [0, 7, 2**32 + 5, 2**62 + 3], ids=["draw-0", "draw-7", "draw-above-2^32", "draw-2^62"])
def test_draw_words_equal_the_reference(num_q_blocks, draw):
    draws = torch.tensor(draw, dtype=torch.int64)
    want, _, _, _ = philox4x32_10(_DRAW_KEY, torch.arange(num_q_blocks), draws.view(1), draws.view(1) >> 32)
    got = triton_draw_words(num_q_blocks, draws.to(DEV), _DRAW_KEY)
    assert got.dtype == torch.int64 and got.shape == (num_q_blocks,)
    assert torch.equal(got.cpu(), want)
    assert int(got.min()) >= 0 and int(got.max()) < 2**32


def test_draw_words_no_blocks():
    assert triton_draw_words(0, torch.tensor(3, device=DEV), _DRAW_KEY).shape == (0,)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: triton_draw_words(4, torch.tensor([1, 2]), 5), "one element"),
        (lambda: triton_draw_words(4, torch.tensor(1.0), 5), "integer tensor"),
        (lambda: triton_draw_words(4, torch.tensor(1), 2**63), "key must be an int"),
    ],
    ids=["two-draws", "float-draw", "key-2^63"],
)
def test_draw_words_reject_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
def test_draw_query_blocks_on_gpu_equal_the_cpu_path():
    for draw in (0, 1, 12345, 2**40 + 1):
        got = draw_query_blocks(1024, 8, torch.tensor(draw, device="cuda"))
        want = draw_query_blocks(1024, 8, torch.tensor(draw))
        assert torch.equal(got.cpu(), want)
