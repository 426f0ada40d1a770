"""The canonical-merge kernel (kernels/triton/canonical.py) against ``sparse_train.index.block_index.canonicalize``
(its PyTorch path, the owner of the invariants): equal indices and counts, exactly."""

import pytest
import torch

from sparse_train.index.block_index import canonicalize
from sparse_train.kernels.triton.canonical import triton_canonical_merge

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")


def _picks(B, HKV, nqb, nkb, k, seed):
    """Candidates as a selector hands them over, and worse: -1 slots, duplicates, blocks past the causal
    limit and outside [0, NKB) (check="none" drops them)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(-3, nkb + 3, (B, HKV, nqb, k), generator=g)
    picks[..., : k // 2] = picks[..., : k // 2].clamp(-1, nkb - 1)
    if k > 1:
        picks[..., 1] = picks[..., 0]  # a duplicate in every row
    return picks


CASES = [
    # (B, HKV, N, BQ, BK, k, window, sinks, capacity)
    pytest.param(1, 2, 1024, 64, 64, 6, 2, 1, 16, id="aligned"),
    pytest.param(2, 1, 1000, 32, 16, 5, 3, 2, 8, id="odd-n-bq32-bk16-rows-cut-to-capacity"),
    pytest.param(1, 1, 512, 64, 64, 0, 3, 1, 4, id="no-picks"),
    pytest.param(1, 1, 300, 16, 16, 4, 0, 0, 19, id="no-forced-blocks-capacity-nkb"),
    pytest.param(1, 3, 777, 64, 32, 3, 40, 30, 25, id="window-and-sinks-beyond-the-row"),
]


@pytest.mark.parametrize("B,HKV,N,BQ,BK,k,window,sinks,capacity", CASES)
def test_merge_kernel_equals_canonicalize(B, HKV, N, BQ, BK, k, window, sinks, capacity):
    nqb, nkb = -(-N // BQ), -(-N // BK)
    picks = _picks(B, HKV, nqb, nkb, k, seed=N + k)
    ref_indices, ref_counts = canonicalize(
        picks, seq_len=N, block_q=BQ, block_k=BK, window=window, sinks=sinks, capacity=capacity, check="none"
    )
    indices, counts = triton_canonical_merge(
        picks.to(DEV), seq_len=N, block_q=BQ, block_k=BK, window=window, sinks=sinks, capacity=min(capacity, nkb)
    )
    assert indices.dtype == counts.dtype == torch.int32
    assert torch.equal(indices.cpu(), ref_indices) and torch.equal(counts.cpu(), ref_counts)
    assert (counts > 0).any()


def test_merge_kernel_drops_picks_beyond_int32_instead_of_wrapping_them():
    """A pick of 2**32 + 3 would read as block 3 if narrowed to int32 before its range test."""
    picks = torch.full((1, 1, 16, 2), -1, dtype=torch.int64)
    picks[0, 0, 10, 0] = 2**32 + 3
    picks[0, 0, 10, 1] = -(2**32) + 5
    args = dict(seq_len=1024, block_q=64, block_k=64, window=1, sinks=0, capacity=4)
    want = canonicalize(picks, check="none", **args)
    got = triton_canonical_merge(picks.to(DEV), **args)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert got[0][0, 0, 10].tolist() == [10, -1, -1, -1]


def test_merge_kernel_reads_strided_picks():
    picks = _picks(1, 2, 16, 16, 8, seed=1)
    strided = picks.transpose(2, 3).contiguous().transpose(2, 3)  # the same values through other strides
    want = triton_canonical_merge(picks.to(DEV), seq_len=1024, block_q=64, block_k=64, window=2, sinks=1, capacity=16)
    got = triton_canonical_merge(strided.to(DEV), seq_len=1024, block_q=64, block_k=64, window=2, sinks=1, capacity=16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
def test_canonicalize_on_gpu_takes_the_kernel_and_equals_the_cpu_path(monkeypatch):
    import sparse_train.kernels.triton.canonical as canonical_mod

    calls = []
    real = canonical_mod.triton_canonical_merge
    monkeypatch.setattr(canonical_mod, "triton_canonical_merge", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    picks = _picks(1, 8, 1024, 1024, 16, seed=3)
    args = dict(seq_len=65536, block_q=64, block_k=64, window=8, sinks=1, capacity=32, check="none")
    got = canonicalize(picks.cuda(), **args)
    want = canonicalize(picks, **args)
    assert calls == [1]
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
