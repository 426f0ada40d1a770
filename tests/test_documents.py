"""Packed documents (sparse_train.documents): the conversions, the argument checks, and the PyTorch
reference with the document mask, which must equal running every document alone through the reference
with the full selection (float64)."""

import math

import pytest
import torch
from builders import make_qkv, random_index

import sparse_train as st
from sparse_train.documents import (
    block_document_ranges,
    check_document_ids,
    cu_seqlens_from_document_ids,
    document_ids_from_cu_seqlens,
    document_ids_from_position_ids,
)
from sparse_train.functional import dense_causal_attention
from sparse_train.index.block_index import BlockIndex
from sparse_train.kernels.reference.attention import (
    dense_block_mask_attention,
    dropout_keep_mask,
    reference_sparse_attention,
)
from sparse_train.kernels.reference.block_mass import (
    reference_dense_block_mass,
    reference_sparse_block_mass,
)


def ids_from_lengths(lengths_per_row, seq_len):
    """int64 ``[B, N]`` ids from per-row document lengths (a tail past their sum is one more document).
    Ids go up by 2 per document so the kernels never rely on consecutive ids."""
    rows = []
    for lengths in lengths_per_row:
        row = torch.cat([torch.full((n,), 2 * d, dtype=torch.int64) for d, n in enumerate(lengths)])
        tail = seq_len - row.numel()
        assert tail >= 0
        rows.append(torch.cat([row, torch.full((tail,), 2 * len(lengths), dtype=torch.int64)]))
    return torch.stack(rows)


def doc_spans(ids_row):
    """[(start, end)] of the runs of equal ids of one row."""
    cu = cu_seqlens_from_document_ids(ids_row).tolist()
    return list(zip(cu[:-1], cu[1:]))


# ---------------------------------------------------------------------------------------------- conversions
def test_ids_from_cu_seqlens_one_row_with_tail():
    cu = torch.tensor([0, 3, 4, 8])
    ids = document_ids_from_cu_seqlens(cu, 10)
    assert ids.dtype == torch.int32 and ids.shape == (1, 10)
    assert ids.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2, 3, 3]]


def test_ids_from_cu_seqlens_per_row_with_empty_documents():
    # row 1 holds fewer documents: padded by repeating its last boundary (empty documents)
    cu = torch.tensor([[0, 2, 5, 7], [0, 4, 7, 7]], dtype=torch.int32)
    ids = document_ids_from_cu_seqlens(cu, 7)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1]]


@pytest.mark.parametrize(
    "lengths,n",
    [
        pytest.param([5, 1, 9, 2], 17, id="four-docs"),
        pytest.param([17], 17, id="one-doc"),
        pytest.param([1] * 13, 13, id="singletons"),
    ],
)
def test_round_trips(lengths, n):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = document_ids_from_cu_seqlens(cu, n)
    assert torch.equal(cu_seqlens_from_document_ids(ids[0]), cu)
    assert torch.equal(document_ids_from_cu_seqlens(cu_seqlens_from_document_ids(ids[0]), n), ids)
    # non-consecutive ids convert to the same boundaries
    assert torch.equal(cu_seqlens_from_document_ids(ids[0].long() * 3 + 1), cu)
    # position ids as DataCollatorWithFlattening makes them: each document restarts at 0
    pos = torch.cat([torch.arange(m) for m in lengths]).view(1, -1)
    assert torch.equal(document_ids_from_position_ids(pos), ids)
    assert torch.equal(document_ids_from_position_ids(pos[0]), ids)


def test_cu_seqlens_from_batched_ids_is_a_list():
    ids = torch.tensor([[0, 0, 1, 1, 1], [4, 4, 4, 4, 9]])
    out = cu_seqlens_from_document_ids(ids)
    assert [t.tolist() for t in out] == [[0, 2, 5], [0, 4, 5]]


def test_position_ids_jump_starts_a_document():
    # a document may start at any position (not only 0): what counts is the break in the +1 steps
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 0], [3, 4, 5, 6, 7, 8, 9, 10]])
    assert document_ids_from_position_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 3], [0] * 8]


@pytest.mark.parametrize(
    "n,block", [(37, 8), (32, 8), (5, 16), (1, 1)], ids=["odd37-b8", "even32-b8", "short5-b16", "one-token"]
)
def test_block_document_ranges(n, block):
    g = torch.Generator().manual_seed(n)
    ids = torch.cumsum((torch.rand(2, n, generator=g) < 0.2).long(), dim=1)
    ranges = block_document_ranges(ids, block)
    assert ranges.shape == (2, math.ceil(n / block), 2)
    for b in range(2):
        for i in range(math.ceil(n / block)):
            chunk = ids[b, i * block : (i + 1) * block]
            assert ranges[b, i].tolist() == [int(chunk.min()), int(chunk.max())]


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "ids,message",
    [
        pytest.param(torch.zeros(2, 9), "int32 or int64", id="float"),
        pytest.param(torch.zeros(2, 9, dtype=torch.int16), "int32 or int64", id="int16"),
        pytest.param(torch.zeros(2, 9, dtype=torch.bool), "int32 or int64", id="bool"),
        pytest.param(torch.zeros(9, dtype=torch.int64), r"shape \[B, N\] = \[2, 9\]", id="1-D"),
        pytest.param(torch.zeros(2, 8, dtype=torch.int64), r"shape \[B, N\] = \[2, 9\]", id="short"),
        pytest.param(torch.zeros(2, 9, dtype=torch.int32, device="meta"), "is on meta", id="device"),
        pytest.param(
            torch.tensor([[0] * 9, [0, 0, 1, 1, 1, 1, 0, 2, 2]]),
            r"row 1: document_ids\[1, 6\] = 0 < "
            r"document_ids\[1, 5\] = 1",
            id="decreasing",
        ),
        pytest.param(torch.tensor([[0] * 9, [-1] * 9]), r"document_ids\[1, 0\] = -1", id="negative"),
        pytest.param(torch.tensor([[0] * 8 + [2**31]] * 2), r"\[0, 2\*\*31\)", id="too-large"),
        pytest.param([[0] * 9] * 2, "torch.Tensor", id="list"),
    ],
)
def test_check_document_ids_errors(ids, message):
    with pytest.raises(ValueError, match=message):
        check_document_ids(ids, 2, 9, "cpu")


def test_document_ids_validated_by_every_entry_point():
    B, HQ, HKV, N, D = 2, 2, 1, 9, 16
    q, k, v = make_qkv(B, HQ, HKV, N, D)
    idx = BlockIndex.full(B, HKV, N, block_q=16, block_k=16)
    bad = torch.tensor([[0] * 9, [0, 1, 0, 1, 1, 1, 1, 1, 1]])
    for call in (
        lambda: st.sparse_attention(q, k, v, idx, document_ids=bad),
        lambda: st.sparse_attention(q, k, v, idx, document_ids=bad, backend="reference"),
        lambda: reference_sparse_attention(q, k, v, idx, document_ids=bad),
        lambda: reference_sparse_block_mass(q, k, idx, scale=0.25, document_ids=bad),
        lambda: reference_dense_block_mass(q, k, block_q=16, block_k=16, scale=0.25, document_ids=bad),
    ):
        with pytest.raises(ValueError, match="non-decreasing"):
            call()
    with pytest.raises(ValueError, match="document_ids must have shape"):
        st.sparse_attention(q, k, v, idx, document_ids=bad[:1])


@pytest.mark.parametrize(
    "cu,message",
    [
        pytest.param(torch.tensor([1, 4, 9]), "start at 0", id="not-from-0"),
        pytest.param(torch.tensor([0, 5, 4, 9]), r"cu_seqlens\[2\] = 4 < cu_seqlens\[1\] = 5", id="decreasing"),
        pytest.param(torch.tensor([0, 5, 10]), "at most at seq_len=9", id="past-end"),
        pytest.param(torch.tensor([0.0, 9.0]), "integer dtype", id="float"),
        pytest.param(torch.zeros(1, 1, 2, dtype=torch.int64), r"\[D\+1\] or \[B, D\+1\]", id="3-D"),
    ],
)
def test_cu_seqlens_errors(cu, message):
    with pytest.raises(ValueError, match=message):
        document_ids_from_cu_seqlens(cu, 9)


# ---------------------------------------------------------------------------------------------- reference
# Each case: B, HQ, HKV, N, BQ, BK, document lengths per row, seq_lens (None or per row)
DOC_CASES = [
    pytest.param(1, 2, 2, 97, 16, 16, [[7, 3, 9, 5, 8, 6, 4, 9, 3, 7, 5, 8, 6, 4, 13]], None, id="many-short-odd97"),
    pytest.param(1, 4, 2, 101, 16, 16, [[61, 5, 3, 7, 2, 20, 3]], None, id="long-plus-short-gqa2"),
    pytest.param(1, 2, 1, 45, 16, 16, [[1, 2, 3, 1, 5, 2, 4, 1, 3, 2]], None, id="shorter-than-block-tail-gqa2"),
    pytest.param(1, 2, 2, 77, 32, 16, [[10, 17, 23, 27]], None, id="inside-blocks-bq32-bk16"),
    pytest.param(2, 4, 1, 83, 16, 32, [[20, 30, 33], [5, 60, 18]], [83, 51], id="seq_lens-gqa4-bq16-bk32"),
    pytest.param(2, 2, 2, 70, 16, 16, [[30, 25], [50, 20]], [64, 50], id="seq_lens-padding-own-document"),
    pytest.param(1, 2, 2, 40, 16, 16, [[40]], None, id="one-document"),
]


def _grads(fn, tensors, do):
    xs = [t.detach().clone().requires_grad_() for t in tensors]
    o, lse = fn(*xs)
    return (o, lse, *torch.autograd.grad((o * do).sum(), xs))


@pytest.mark.parametrize("B,HQ,HKV,N,BQ,BK,lengths,seq_lens", DOC_CASES)
def test_reference_equals_each_document_alone(B, HQ, HKV, N, BQ, BK, lengths, seq_lens):
    D = 16
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float64, seed=N)
    do = torch.randn(B, HQ, N, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids = ids_from_lengths(lengths, N)
    lens = None if seq_lens is None else torch.tensor(seq_lens)
    full = BlockIndex.full(B, HKV, N, block_q=BQ, block_k=BK)
    o, lse, dq, dk, dv = _grads(
        lambda a, b, c: reference_sparse_attention(a, b, c, full, seq_lens=lens, document_ids=ids), (q, k, v), do
    )
    for b in range(B):
        for s, e in doc_spans(ids[b]):
            alone = BlockIndex.full(1, HKV, e - s, block_q=BQ, block_k=BK)
            alone_lens = None if lens is None else torch.tensor([min(max(int(lens[b]) - s, 0), e - s)])
            sl = (slice(b, b + 1), slice(None), slice(s, e))
            expected = _grads(
                lambda a, b_, c: reference_sparse_attention(a, b_, c, alone, seq_lens=alone_lens),
                (q[sl], k[sl], v[sl]),
                do[sl],
            )
            got = (o[sl], lse[sl], dq[sl], dk[sl], dv[sl])
            for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), got, expected):
                torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=f"{name} of document [{s}, {e}) row {b}")


@pytest.mark.parametrize("B,HQ,HKV,N,BQ,BK,lengths,seq_lens", DOC_CASES[:5])
def test_reference_random_selection_equals_dense_mask(B, HQ, HKV, N, BQ, BK, lengths, seq_lens):
    """Sparse selections: the chunked reference equals the naive element-mask computation."""
    D = 16
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float64, seed=N + 1)
    ids = ids_from_lengths(lengths, N)
    lens = None if seq_lens is None else torch.tensor(seq_lens)
    idx = random_index(B, HKV, N, BQ, BK, 2, 1, 1, seed=N)
    o, lse = reference_sparse_attention(q, k, v, idx, seq_lens=lens, document_ids=ids, chunk_q_blocks=2)
    o2, lse2 = dense_block_mask_attention(q, k, v, idx, seq_lens=lens, document_ids=ids)
    torch.testing.assert_close(o, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("B,HQ,HKV,N,BQ,BK,lengths,seq_lens", DOC_CASES[3:6])
def test_dense_causal_attention_with_documents(B, HQ, HKV, N, BQ, BK, lengths, seq_lens):
    D = 16
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float64, seed=N + 2)
    ids = ids_from_lengths(lengths, N).to(torch.int32)
    lens = None if seq_lens is None else torch.tensor(seq_lens)
    full = BlockIndex.full(B, HKV, N, block_q=BQ, block_k=BK)
    o_ref = st.sparse_attention(q, k, v, full, seq_lens=lens, document_ids=ids, backend="reference")
    o = dense_causal_attention(q, k, v, seq_lens=lens, document_ids=ids)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)


def test_reference_dropout_bits_are_global_positions():
    """With documents, dropout removes the same elements as without: the keep bit of (b, h, q, k) is a
    function of the global positions, and the document mask only zeroes probabilities."""
    B, HQ, HKV, N, D, p, seed = 1, 2, 1, 37, 16, 0.3, 1234
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float64, seed=5)
    ids = ids_from_lengths([[9, 13, 4, 11]], N)
    full = BlockIndex.full(B, HKV, N, block_q=16, block_k=16)
    o, lse = reference_sparse_attention(q, k, v, full, document_ids=ids, dropout_p=p, dropout_seed=seed)
    pos = torch.arange(N)
    allowed = (pos.view(1, -1) <= pos.view(-1, 1)) & (ids[0].view(1, -1) == ids[0].view(-1, 1))
    s = (q @ k.repeat_interleave(HQ // HKV, 1).transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(s, dim=-1)
    keep = dropout_keep_mask(
        seed,
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.arange(HQ).view(1, -1, 1, 1),
        pos.view(1, 1, -1, 1),
        pos.view(1, 1, 1, -1),
        HQ,
        N,
        p,
    )
    expected = (probs * keep / (1 - p)) @ v.repeat_interleave(HQ // HKV, 1)
    torch.testing.assert_close(o, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-12, atol=1e-12)


def test_reference_block_mass_with_documents():
    """Sparse and dense block-mass references with documents: mass only on blocks of the row's own
    document, and the full selection's target equals the dense target."""
    B, HQ, HKV, N, D, BS = 1, 2, 1, 53, 16, 16
    q, k, _ = make_qkv(B, HQ, HKV, N, D, torch.float64, seed=9)
    ids = ids_from_lengths([[20, 3, 18, 12]], N)
    full = BlockIndex.full(B, HKV, N, block_q=BS, block_k=BS)
    sparse, valid = reference_sparse_block_mass(q, k, full, scale=0.25, document_ids=ids, row_pool="max")
    dense, dvalid = reference_dense_block_mass(q, k, block_q=BS, block_k=BS, scale=0.25, document_ids=ids)
    nkb = math.ceil(N / BS)
    torch.testing.assert_close(sparse[..., :nkb].float(), dense.float(), rtol=1e-6, atol=1e-7)
    assert torch.equal(valid, dvalid)
    # query block 2 (positions 32..47) holds documents 2 (23..40) and 3 (41..52): no mass on key block 0
    ranges = block_document_ranges(ids, BS)
    assert int(ranges[0, 0, 1]) < int(ranges[0, 2, 0])
    assert float(dense[0, 0, 2, 0]) == 0.0 and float(dense[0, 0, 2, 1]) > 0.0


def test_random_document_lengths_are_seeded_and_cover_the_total():
    lengths = st.documents.random_document_lengths(1000, 40, 300, seed=3)
    assert sum(lengths) == 1000 and all(1 <= n <= 300 for n in lengths) and all(n >= 40 for n in lengths[:-1])
    assert st.documents.random_document_lengths(1000, 40, 300, seed=3) == lengths
    assert st.documents.random_document_lengths(1000, 40, 300, seed=4) != lengths
    assert st.documents.random_document_lengths(0, 1, 5, seed=0) == []
    with pytest.raises(ValueError, match="high"):
        st.documents.random_document_lengths(10, 5, 4, seed=0)
