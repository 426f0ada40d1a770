"""BlockIndex with packed documents: cross-document blocks dropped, window and sinks per document,
against hand-made block masks and a slow per-token Python oracle."""

import math

import pytest
import torch
from builders import ids_from_lengths, random_selection

import sparse_train as st


def needed_blocks(ids, bq, bk):
    """bool ``[NQB, NKB]``: some query of block i may see some key of block j (j <= i, same document);
    token by token."""
    n = ids.numel()
    nqb, nkb = math.ceil(n / bq), math.ceil(n / bk)
    out = torch.zeros(nqb, nkb, dtype=torch.bool)
    ids = ids.tolist()
    for qpos in range(n):
        for kpos in range(qpos + 1):
            if ids[qpos] == ids[kpos]:
                out[qpos // bq, kpos // bk] = True
    return out


def oracle_row(cands, i, ids, bq, bk, window, sinks):
    """Candidates + window + per-document sinks of query block i, kept where a token pair is visible."""
    n = len(ids)
    start, end = i * bq, min((i + 1) * bq, n)
    last = (end - 1) // bk
    chosen = {c for c in cands if 0 <= c <= last}
    chosen |= {j for j in range(last - window + 1, last + 1) if j >= 0}
    for doc in sorted(set(ids[start:end])):
        doc_blocks = sorted({t // bk for t in range(n) if ids[t] == doc})
        chosen |= {j for j in doc_blocks[:sinks] if j <= last}
    visible = set()
    for j in chosen:
        if any(ids[qp] == ids[kp] for qp in range(start, end) for kp in range(j * bk, min((j + 1) * bk, qp + 1))):
            visible.add(j)
    return sorted(visible)


def test_hand_made_masks_bq_equals_bk():
    # 6 blocks of 4 tokens; documents: [0..5], [6..13], [14..23] -> doc 0 in blocks 0-1, doc 1 in
    # blocks 1-3, doc 2 in blocks 3-5.
    ids = ids_from_lengths([6, 8, 10])
    full = st.BlockIndex.full(1, 1, 24, block_q=4, block_k=4, document_ids=ids)
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(full.to_dense()[0, 0], want)
    assert not full.is_full()  # a full *document* selection is not every causal block

    # window 2 and one sink per document, nothing else selected
    empty = torch.full((1, 1, 6, 1), -1)
    idx = st.BlockIndex.from_selection(
        empty, seq_len=24, block_q=4, block_k=4, window=2, sinks=1, document_ids=ids, check="full"
    )
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],  # window {0, 1}; sinks of doc 0 (block 0) and doc 1 (block 1)
            [0, 1, 1, 0, 0, 0],  # window {1, 2}, sink of doc 1 = block 1
            [0, 1, 1, 1, 0, 0],  # window {2, 3}; doc 1's sink 1; doc 2 starts in block 3 (its sink)
            [0, 0, 0, 1, 1, 0],  # window {3, 4}; doc 2's sink is block 3 (not the row's block 0)
            [0, 0, 0, 1, 1, 1],  # window {4, 5}; sink 3
        ],
        dtype=torch.bool,
    )
    assert torch.equal(idx.to_dense()[0, 0], want)

    # a dynamic pick of a block of another document is dropped; one of the same document is kept
    sel = torch.full((1, 1, 6, 1), -1)
    sel[0, 0, 5, 0] = 0  # doc 2's query block picking doc 0's block: dropped
    sel[0, 0, 3, 0] = 1  # block 3 holds doc 1 tokens, block 1 too: kept
    idx = st.BlockIndex.from_selection(sel, seq_len=24, block_q=4, block_k=4, document_ids=ids)
    assert idx.to_dense()[0, 0].nonzero().tolist() == [[3, 1]]


def test_hand_made_sinks_are_per_document_and_stay_inside_the_document():
    # 8 blocks of 4 tokens; doc 0 = tokens 0..2 (block 0 only), doc 1 = 3..31 (blocks 0-7)
    ids = ids_from_lengths([3, 29])
    empty = torch.full((1, 1, 8, 0), -1)
    idx = st.BlockIndex.from_selection(empty, seq_len=32, block_q=4, block_k=4, sinks=2, document_ids=ids)
    rows = [idx.indices[0, 0, i, : idx.counts[0, 0, i]].tolist() for i in range(8)]
    # doc 1's first two blocks are 0 and 1; block 0 holds doc 1 token 3, so it is a sink of doc 1
    assert rows == [[0], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1]]
    # a later document: its sinks start at its own first block
    ids = ids_from_lengths([9, 23])  # doc 1 starts at token 9 (block 2)
    idx = st.BlockIndex.from_selection(empty, seq_len=32, block_q=4, block_k=4, sinks=2, document_ids=ids)
    rows = [idx.indices[0, 0, i, : idx.counts[0, 0, i]].tolist() for i in range(8)]
    # block 2 holds doc 0 (tokens 8) and doc 1: doc 0's sinks 0, 1 and doc 1's sink 2 (3 is not causal)
    assert rows == [[0], [0, 1], [0, 1, 2], [2, 3], [2, 3], [2, 3], [2, 3], [2, 3]]


def test_more_sinks_than_key_blocks_are_every_block_without_a_sink_per_count():
    """sinks far past the key-block count select what sinks = NKB selects, without an arange of ``sinks`` entries
    (10**9 sinks asked for 8 GB)."""
    ids = ids_from_lengths([9, 23])
    empty = torch.full((1, 1, 8, 0), -1)
    rows = {}
    for sinks in (8, 10**9):
        idx = st.BlockIndex.from_selection(empty, seq_len=32, block_q=4, block_k=4, sinks=sinks, document_ids=ids)
        rows[sinks] = [idx.indices[0, 0, i, : idx.counts[0, 0, i]].tolist() for i in range(8)]
    assert rows[10**9] == rows[8]
    # every causal block of the query block's documents
    assert rows[8] == [[0], [0, 1], [0, 1, 2], [2, 3], [2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7]]
    sinks = st.index.document_sink_candidates(ids, 10**9, seq_len=32, block_q=4, block_k=4)
    assert sinks.shape[-1] <= 8 + (4 - 1) // 4 + 2


def test_documents_shorter_than_a_block_and_bq_larger_than_bk():
    # query blocks of 8 over key blocks of 4; documents of 1-3 tokens start inside the query blocks
    ids = ids_from_lengths([2, 1, 3, 5, 1, 2, 6])  # N = 20
    empty = torch.full((1, 1, 3, 0), -1)
    for sinks in (1, 2):
        idx = st.BlockIndex.from_selection(
            empty, seq_len=20, block_q=8, block_k=4, sinks=sinks, document_ids=ids, check="full"
        )
        for i in range(3):
            row = idx.indices[0, 0, i, : idx.counts[0, 0, i]].tolist()
            assert row == oracle_row([], i, ids[0].tolist(), 8, 4, 0, sinks), (sinks, i)


CASES = [
    # (lengths per row, bq, bk, k, window, sinks)
    pytest.param([[70, 30, 41], [5, 5, 5, 126]], 16, 16, 3, 2, 1, id="aligned-mixed"),
    pytest.param([[7] * 19 + [4]], 16, 16, 4, 1, 2, id="many-short-docs"),
    pytest.param([[100, 3, 3, 3, 20]], 32, 16, 3, 2, 2, id="bq32-bk16-one-long"),
    pytest.param([[13, 50, 60], [123]], 16, 32, 2, 1, 1, id="bq16-bk32"),
    pytest.param([[1, 1, 1, 40, 1, 30]], 24, 16, 2, 0, 3, id="bq24-bk16-sinks-only-odd"),
    pytest.param([[33, 33, 33]], 16, 16, 2, 3, 0, id="window-only"),
]


@pytest.mark.parametrize("lengths,bq,bk,k,window,sinks", CASES)
def test_canonicalize_with_documents_matches_oracle(lengths, bq, bk, k, window, sinks):
    ids = ids_from_lengths(*lengths)
    batch, n = ids.shape
    sel = random_selection(batch, 2, n, bq, bk, k, seed=n + k, distinct=False, drop=0.3)
    idx = st.BlockIndex.from_selection(
        sel,
        seq_len=n,
        block_q=bq,
        block_k=bk,
        window=window,
        sinks=sinks,
        document_ids=ids.to(torch.int32),
        check="full",
    )
    for b in range(batch):
        for h in range(2):
            for i in range(math.ceil(n / bq)):
                want = oracle_row(sel[b, h, i].tolist(), i, ids[b].tolist(), bq, bk, window, sinks)
                count = int(idx.counts[b, h, i])
                assert idx.indices[b, h, i, :count].tolist() == want, (b, h, i)
                assert (idx.indices[b, h, i, count:] == -1).all()


@pytest.mark.parametrize("seed", range(6))
def test_full_selection_holds_every_visible_pair_and_nothing_cross_document(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(20, 140, (1,), generator=g))
    bq, bk = [(16, 16), (32, 16), (16, 32), (24, 16)][seed % 4]
    # random boundaries, documents as short as one token, ids with gaps
    cuts = torch.rand(n, generator=g) < 0.08
    ids = (torch.cumsum(cuts.to(torch.int64), 0) * 3).view(1, n)
    sel = random_selection(1, 1, n, bq, bk, 100, seed=seed)  # every causal block
    idx = st.BlockIndex.from_selection(sel, seq_len=n, block_q=bq, block_k=bk, window=1, sinks=1, document_ids=ids)
    assert torch.equal(idx.to_dense()[0, 0], needed_blocks(ids[0], bq, bk))
    assert torch.equal(
        st.BlockIndex.full(1, 1, n, bq, bk, document_ids=ids).to_dense()[0, 0], needed_blocks(ids[0], bq, bk)
    )


def test_one_document_is_the_plain_index():
    sel = random_selection(2, 2, 300, 64, 32, 3, seed=1, distinct=False, drop=0.2)
    ids = torch.full((2, 300), 7)
    plain = st.BlockIndex.from_selection(sel, seq_len=300, block_q=64, block_k=32, window=2, sinks=2)
    docs = st.BlockIndex.from_selection(sel, seq_len=300, block_q=64, block_k=32, window=2, sinks=2, document_ids=ids)
    assert torch.equal(plain.indices, docs.indices) and torch.equal(plain.counts, docs.counts)


def test_from_csr_takes_document_ids_and_repr_works():
    ids = ids_from_lengths([40, 24])
    indptr = torch.arange(5)  # one candidate per row: block 0
    idx = st.BlockIndex.from_csr(
        indptr,
        torch.zeros(4, dtype=torch.int64),
        batch=1,
        num_kv_heads=1,
        seq_len=64,
        block_q=16,
        block_k=16,
        document_ids=ids,
    )
    # doc 1 starts at 40 (block 2): block 0 is cross-document for query block 3 only
    assert idx.counts.tolist() == [[[1, 1, 1, 0]]]
    text = repr(idx)
    assert "BlockIndex(" in text and "density=" in text
    assert 0.0 < idx.density() < 1.0


@pytest.mark.parametrize(
    "make,match",
    [
        pytest.param(lambda: torch.zeros(2, 64, dtype=torch.int64), r"shape \[B, N\] = \[1, 64\]", id="batch"),
        pytest.param(lambda: torch.zeros(1, 63, dtype=torch.int64), r"shape \[B, N\]", id="length"),
        pytest.param(lambda: torch.zeros(1, 64), "int32 or int64", id="float"),
        pytest.param(lambda: torch.arange(64).flip(0).view(1, 64), "non-decreasing", id="decreasing"),
        pytest.param(lambda: torch.full((1, 64), -2), r"\[0, 2\*\*31\)", id="negative"),
    ],
)
def test_rejects_bad_document_ids(make, match):
    sel = torch.zeros(1, 1, 4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        st.BlockIndex.from_selection(sel, seq_len=64, block_q=16, block_k=16, document_ids=make())
