"""The Triton block-mass kernel (selector distillation target) against the PyTorch reference."""

import pytest
import torch
from builders import make_qkv, random_index

import sparse_train.kernels.triton.block_mass as block_mass_mod
from sparse_train.index.block_index import BlockIndex
from sparse_train.kernels.reference.attention import reference_sparse_attention
from sparse_train.kernels.reference.block_mass import (
    dense_row_block_mass,
    reference_dense_block_mass,
    reference_sparse_block_mass,
)
from sparse_train.kernels.triton.block_mass import row_log_mass_launch, triton_block_mass, triton_dense_block_mass
from sparse_train.selection.distill import dense_block_mass, sparse_block_mass

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh outputs start as NaN

CASES = [
    # (B, HQ, HKV, N, D, BQ, BK, topk, window, sinks, seq_lens)
    pytest.param(1, 4, 2, 128, 16, 32, 32, 2, 1, 1, None, id="gqa2-aligned"),
    pytest.param(2, 4, 1, 147, 32, 32, 16, 3, 1, 0, (147, 90), id="mqa-odd-seq-lens"),
    pytest.param(1, 2, 2, 100, 16, 16, 32, 2, 0, 1, None, id="mha-bq16-bk32"),
]


@pytest.mark.parametrize("row_pool", ["max", "mean"], ids=["row-max", "row-mean"])
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,topk,window,sinks,seq_lens", CASES)
def test_block_mass_matches_reference(B, HQ, HKV, N, D, BQ, BK, topk, window, sinks, seq_lens, row_pool):
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N, device=DEV)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV)
    scale = D**-0.5
    _, lse = reference_sparse_attention(q, k, v, idx, scale=scale, seq_lens=lens)
    target, valid = triton_block_mass(q, k, lse, idx, scale=scale, seq_lens=lens, row_pool=row_pool)
    ref_target, ref_valid = reference_sparse_block_mass(
        q.double(), k.double(), idx, scale=scale, lse=lse.double(), seq_lens=lens, row_pool=row_pool
    )
    err = (target.double() - ref_target).abs().max().item()
    print(f"block mass max abs err vs fp64 reference: {err:.2e}")
    assert torch.equal(valid, ref_valid)
    assert err < 1e-5
    sums = target.sum(-1)[valid]
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5)
    assert torch.all(target[idx.indices < 0] == 0)


def test_block_mass_empty_rows_are_invalid():
    idx = random_index(1, 1, 96, 32, 32, 1, 0, 0, seed=3, device=DEV)
    sel = idx.indices.clone()
    sel[:, :, 1] = -1  # query block 1 selects nothing
    idx = BlockIndex.from_selection(sel, seq_len=96, block_q=32, block_k=32)
    q, k, v = make_qkv(1, 2, 1, 96, 16, torch.float32, seed=3, device=DEV)
    _, lse = reference_sparse_attention(q, k, v, idx)
    target, valid = triton_block_mass(q, k, lse, idx, scale=16**-0.5)
    assert not bool(valid[0, 0, 1]) and torch.all(target[0, 0, 1] == 0)
    assert bool(valid[0, 0, 0])


def test_block_mass_rejects_bad_lse():
    idx = random_index(1, 1, 64, 32, 32, 1, 1, 0, seed=1, device=DEV)
    q, k, _ = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=1, device=DEV)
    with pytest.raises(ValueError, match="lse must be float32"):
        triton_block_mass(q, k, torch.zeros(1, 2, 63, device=DEV), idx, scale=0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_block_mass_gpu_real_size(dtype):
    B, HQ, HKV, N, D = 1, 8, 2, 4099, 128
    idx = random_index(B, HKV, N, 64, 64, 8, 4, 1, seed=7, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, seed=7, device="cuda")
    from sparse_train.kernels.triton.op import triton_sparse_attention

    _, lse = triton_sparse_attention(q, k, v, idx)
    target, valid = sparse_block_mass(q, k, idx, scale=D**-0.5, lse=lse)  # dispatches to the kernel
    idx_cpu = idx.to("cpu")
    ref, ref_valid = reference_sparse_block_mass(
        q.cpu().double(), k.cpu().double(), idx_cpu, scale=D**-0.5, lse=lse.cpu().double()
    )
    err = (target.cpu().double() - ref).abs().max().item()
    print(f"{dtype}: block mass max abs err {err:.2e}")
    assert torch.equal(valid.cpu(), ref_valid)
    assert err < 1e-3  # same bf16/fp16 inputs on both sides: only fp32 accumulation order differs


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_block_mass_ignores_nonfinite_padding(poison):
    """Query rows and keys past seq_lens are never loaded: garbage there leaves the target unchanged."""
    idx = random_index(2, 1, 96, 32, 32, 2, 1, 1, seed=9, device=DEV)
    q, k, v = make_qkv(2, 2, 1, 96, 16, torch.float32, seed=9, device=DEV)
    lens = torch.tensor([96, 50], device=DEV)
    _, lse = reference_sparse_attention(q, k, v, idx, seq_lens=lens)
    clean = triton_block_mass(q, k, lse, idx, scale=0.25, seq_lens=lens)
    q2, k2, lse2 = q.clone(), k.clone(), lse.clone()
    q2[1, :, 50:] = poison
    k2[1, :, 50:] = poison
    lse2[1, :, 50:] = poison
    dirty = triton_block_mass(q2, k2, lse2, idx, scale=0.25, seq_lens=lens)
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])


def test_block_mass_rejects_non_finite_scale():
    idx = random_index(1, 1, 64, 32, 32, 1, 1, 0, seed=1, device=DEV)
    q, k, v = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=1, device=DEV)
    _, lse = reference_sparse_attention(q, k, v, idx)
    with pytest.raises(ValueError, match="scale must be finite"):
        triton_block_mass(q, k, lse, idx, scale=float("nan"))


DENSE_CASES = [
    # (B, HQ, HKV, N, D, BQ, BK, query blocks, seq_lens)
    pytest.param(1, 4, 2, 128, 16, 32, 32, (0, 3), None, id="gqa2-aligned"),
    pytest.param(2, 4, 1, 147, 32, 32, 16, (1, 4, 2), (147, 90), id="mqa-odd-seq-lens"),
    pytest.param(1, 2, 2, 100, 16, 16, 32, (6,), None, id="mha-bq16-bk32"),
]


@pytest.mark.parametrize("row_pool", ["max", "mean"], ids=["row-max", "row-mean"])
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,blocks,seq_lens", DENSE_CASES)
def test_dense_block_mass_kernels_match_reference(B, HQ, HKV, N, D, BQ, BK, blocks, seq_lens, row_pool):
    """The sampled dense target through the per-row log-mass kernel equals the PyTorch reference
    (padding past seq_lens poisoned with NaN: it must not matter)."""
    q, k, _ = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV)
    if lens is not None:
        for b, length in enumerate(seq_lens):
            q[b, :, length:] = float("nan")
            k[b, :, length:] = float("nan")
    picks = torch.tensor(blocks)
    scale = D**-0.5
    target, valid = triton_dense_block_mass(
        q, k, picks, block_q=BQ, block_k=BK, scale=scale, seq_lens=lens, row_pool=row_pool
    )
    ref, ref_valid = reference_dense_block_mass(
        q.cpu().double(),
        k.cpu().double(),
        block_q=BQ,
        block_k=BK,
        scale=scale,
        seq_lens=None if lens is None else lens.cpu(),
        query_blocks=picks,
        row_pool=row_pool,
    )
    err = (target.cpu().double() - ref).abs().max().item()
    print(f"dense block mass ({row_pool}) max abs err vs fp64 reference: {err:.2e}")
    assert torch.equal(valid.cpu(), ref_valid)
    assert err < 1e-5


@pytest.mark.parametrize("per_chunk", [1, 3, 64], ids=["chunk1", "chunk3", "one-chunk"])
def test_row_log_mass_rows_match_reference(monkeypatch, per_chunk):
    """Per row, the kernel's log masses normalised by the row's own log-sum-exp are the reference's
    per-row dense masses, whatever the number of key blocks per program (a late block's row is cut into
    several programs on the GPU; here the chunk is forced). Padding is NaN-poisoned, N is odd and the
    second row is shorter, so one sampled block is partly and one wholly past its sequence's end."""
    monkeypatch.setattr(block_mass_mod, "row_log_mass_chunk", lambda num_k_blocks, programs, device: per_chunk)
    B, HQ, HKV, N, D, BQ, BK = 2, 4, 2, 147, 16, 16, 32
    q, k, _ = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=3, device=DEV)
    lens = torch.tensor([147, 70], device=DEV)
    q[1, :, 70:] = float("nan")
    k[1, :, 70:] = float("nan")
    picks = torch.tensor([9, 4, 0, 6], device=DEV)
    log_mass = row_log_mass_launch(
        q, k, picks.to(torch.int32), block_q=BQ, block_k=BK, scale=D**-0.5, seq_lens=lens
    )  # [B, HQ, S, NKB, BQ]
    lse2 = torch.logsumexp(log_mass.double() * torch.log(torch.tensor(2.0)), dim=3, keepdim=True) / torch.log(
        torch.tensor(2.0)
    )
    rows = torch.exp2(log_mass.double() - lse2).nan_to_num(0.0)  # dead rows: -inf - -inf
    rows = rows.view(B, HKV, HQ // HKV, 4, -1, BQ).permute(0, 1, 3, 2, 5, 4).reshape(B, HKV, 4, -1, log_mass.shape[3])
    ref, ref_ok = dense_row_block_mass(
        q.double(), k.double(), block_q=BQ, block_k=BK, scale=D**-0.5, query_blocks=picks, seq_lens=lens
    )
    ref = torch.where(ref_ok.unsqueeze(-1), ref, 0.0)
    err = (rows - ref).abs().max().item()
    print(f"per-row dense mass, {per_chunk} key blocks per program: max abs err vs fp64 reference {err:.2e}")
    assert err < 1e-5
    live = torch.isfinite(lse2).view(B, HKV, HQ // HKV, 4, BQ).permute(0, 1, 3, 2, 4).reshape(B, HKV, 4, -1)
    assert torch.equal(live, ref_ok.expand_as(live))
    assert not live[1, :, 0].any() and live[1, :, 1].any()  # block 9 (144) is past 70; block 4 starts at 64


def test_dense_block_mass_groups_of_sampled_blocks_equal_one_pass(monkeypatch):
    """With a buffer budget below one sampled block, every block is its own kernel pass: same result."""
    q, k, _ = make_qkv(1, 4, 2, 128, 16, torch.float32, seed=8, device=DEV)
    picks = torch.tensor([3, 0, 7, 5])
    whole, whole_valid = triton_dense_block_mass(q, k, picks, block_q=16, block_k=16, scale=0.25)
    monkeypatch.setattr(block_mass_mod, "DENSE_TARGET_BUFFER_BYTES", 1)
    parts, parts_valid = triton_dense_block_mass(q, k, picks, block_q=16, block_k=16, scale=0.25)
    assert torch.equal(parts, whole) and torch.equal(parts_valid, whole_valid)
    assert whole_valid.all()


@pytest.mark.parametrize(
    "picks,match",
    [
        pytest.param(torch.tensor([0, 8]), r"query_blocks must lie in \[0, 8\)", id="past-last-block"),
        pytest.param(torch.tensor([-1]), r"query_blocks must lie in \[0, 8\)", id="negative"),
        pytest.param(torch.tensor([[0, 1]]), "query_blocks must be 1-D", id="2-d"),
        pytest.param(torch.tensor([0.0, 1.0]), "query_blocks must have an integer dtype", id="float"),
    ],
)
def test_dense_block_mass_rejects_bad_query_blocks(picks, match):
    q, k, _ = make_qkv(1, 2, 1, 128, 16, torch.float32, seed=1, device=DEV)
    with pytest.raises(ValueError, match=match):
        triton_dense_block_mass(q, k, picks, block_q=16, block_k=16, scale=0.25)


@pytest.mark.parametrize(
    "head_dim,block,match",
    [
        pytest.param(24, 16, "head dim 24", id="head-dim-24"),
        pytest.param(16, 24, "block sizes BQ=24", id="block-24"),
    ],
)
def test_dense_block_mass_names_what_the_kernels_cannot_run(head_dim, block, match):
    q, k, _ = make_qkv(1, 2, 1, 96, head_dim, torch.float32, seed=1, device=DEV)
    with pytest.raises(ValueError, match=f"triton_dense_block_mass cannot run this input: {match}"):
        triton_dense_block_mass(q, k, torch.tensor([0]), block_q=block, block_k=block, scale=0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", ["sampled", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dense_block_mass_dispatches_to_kernels_on_gpu(dtype, blocks):
    B, HQ, HKV, N, D = 1, 8, 2, 4099, 128
    q, k, _ = make_qkv(B, HQ, HKV, N, D, dtype, seed=5, device="cuda")
    # "all" is distill="dense": every query block, through the kernels instead of N x N fp32 logits
    picks = torch.tensor([0, 17, 40, 64]) if blocks == "sampled" else None
    target, valid = dense_block_mass(q, k, block_q=64, block_k=64, scale=D**-0.5, query_blocks=picks)
    ref, ref_valid = reference_dense_block_mass(
        q.cpu().double(), k.cpu().double(), block_q=64, block_k=64, scale=D**-0.5, query_blocks=picks
    )
    err = (target.cpu().double() - ref).abs().max().item()
    print(f"{dtype}, {blocks} query blocks: dense block mass max abs err {err:.2e}")
    assert torch.equal(valid.cpu(), ref_valid)
    assert err < 1e-3  # same bf16/fp16 inputs on both sides: only fp32 accumulation order differs


@pytest.mark.parametrize("block_k", [2**30, 16], ids=["key-block-2pow30", "key-block-16"])
def test_reference_block_mass_takes_key_blocks_longer_than_n(block_k):
    """A key block longer than the sequence is one block of its N keys: the dense, per-row and sparse targets
    equal those of a key block of exactly N (2**30 keys of padding per row would need hundreds of GB)."""
    n = 9
    q, k, _ = make_qkv(2, 4, 2, n, 16, torch.float64, seed=4, device=DEV)
    lens = torch.tensor([9, 5], device=DEV)
    common = {"scale": 0.25, "seq_lens": lens}
    dense = reference_dense_block_mass(q, k, block_q=4, block_k=block_k, **common)
    dense_n = reference_dense_block_mass(q, k, block_q=4, block_k=n, **common)
    blocks = torch.arange(3, device=DEV)
    rows = dense_row_block_mass(q, k, block_q=4, block_k=block_k, query_blocks=blocks, **common)
    rows_n = dense_row_block_mass(q, k, block_q=4, block_k=n, query_blocks=blocks, **common)
    sparse = reference_sparse_block_mass(
        q, k, BlockIndex.full(2, 2, n, block_q=4, block_k=block_k, device=DEV), **common
    )
    sparse_n = reference_sparse_block_mass(q, k, BlockIndex.full(2, 2, n, block_q=4, block_k=n, device=DEV), **common)
    for got, want in ((dense, dense_n), (rows, rows_n), (sparse, sparse_n)):
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert dense[0].shape == (2, 2, 3, 1) and torch.all(dense[0][dense[1]] == 1)
