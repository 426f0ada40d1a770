"""Dropout keep bits: the PyTorch Philox reproduces Random123's known answers and Triton's tl.randint
bit for bit, including 64-bit counters past 2**32."""

import pytest
import torch

from sparse_train.kernels.reference.attention import (
    dropout_keep_mask,
    dropout_offsets,
    dropout_threshold,
    philox4x32_10,
)

# Random123 tests/kat_vectors for philox4x32 with 10 rounds: (counter, key, output).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_philox_known_answer(counter, key, expected):
    seed = key[0] | (key[1] << 32)
    words = philox4x32_10(seed, *(torch.tensor([c]) for c in counter))
    assert tuple(int(w) for w in words) == expected


@pytest.fixture(scope="module")
def triton_randint():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def randint_kernel(seed, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = pos < n
        offsets = tl.load(offsets_ptr + pos, mask=inside, other=0)
        bits = tl.randint(seed, offsets)
        tl.store(out_ptr + pos, bits.to(tl.int64, bitcast=False) & 0xFFFFFFFF, mask=inside)

    def run(seed, offsets):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        offsets = offsets.to(device)
        out = torch.empty_like(offsets)
        block = 128
        randint_kernel[(triton.cdiv(offsets.numel(), block),)](seed, offsets, out, offsets.numel(), BLOCK=block)
        return out.cpu()

    return run


@pytest.mark.parametrize(
    "seed", [0, 1, 0x1234_5678, 0xDEAD_BEEF_0BAD_F00D & (2**63 - 1), 2**40 + 17], ids=lambda s: f"seed{s:x}"
)
def test_reference_matches_tl_randint(triton_randint, seed):
    gen = torch.Generator().manual_seed(seed & 0xFFFF)
    small = torch.randint(0, 2**31, (200,), generator=gen, dtype=torch.int64)
    large = torch.randint(2**32, 2**50, (200,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([0, 2**32 - 1, 2**32, 2**33 + 5, 2**62 + 3], dtype=torch.int64)
    offsets = torch.cat([small, large, edges])
    expected = triton_randint(seed, offsets)
    word0, _, _, _ = philox4x32_10(seed, offsets & 0xFFFFFFFF, offsets >> 32)
    mismatches = int((word0 != expected).sum())
    assert mismatches == 0, f"{mismatches} of {offsets.numel()} words differ from tl.randint"


def test_offsets_are_coordinates_only():
    b, h, q, k = (torch.tensor(x) for x in (1, 3, 70, 65))
    assert int(dropout_offsets(b, h, q, k, num_q_heads=4, seq_len=100)) == ((1 * 4 + 3) * 100 + 70) * 100 + 65


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_keep_rate_and_threshold(p):
    q = torch.arange(256).view(-1, 1)
    k = torch.arange(256).view(1, -1)
    keep = dropout_keep_mask(1234, torch.tensor(0), torch.tensor(1), q, k, num_q_heads=2, seq_len=256, p=p)
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) < 0.01, rate
    assert dropout_threshold(p) == int(p * 2**32)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_threshold_rejects_bad_p(p):
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_threshold(p)
