"""The selector's top-k kernel (kernels/triton/topk.py) against the PyTorch path of ``selection_candidates``: the same
blocks for distinct scores, in every case the kernel takes (window, sinks, seq_lens with empty blocks, context-
parallel rows, rows with fewer candidates than K, NaN scores); validation; the custom op
``sparse_train::selection_topk`` (opcheck, a fullgraph compile against the launcher); the selector on the GPU."""

import pytest
import torch
from builders import compiled_fullgraph

from sparse_train.kernels.triton.topk import topk_blocks, topk_launch, triton_selection_candidates
from sparse_train.selection import selection_candidates, selection_geometry

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")


def _scores(B, HKV, rows, nkb, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    # a random permutation per row: distinct scores, so "the k largest" names one set of blocks
    return torch.rand(B, HKV, rows, nkb, generator=g).argsort(-1).to(torch.float32).to(device) * 0.37 - 50.0


def _sorted(picks):
    return picks.sort(-1).values


CASES = [
    # (B, HKV, N, BQ, BK, top_k, window, sinks, seq_lens)
    pytest.param(1, 2, 1024, 64, 64, 4, 2, 1, None, id="aligned"),
    pytest.param(2, 1, 1000, 32, 16, 6, 3, 2, None, id="odd-n-bq32-bk16"),
    pytest.param(1, 1, 512, 64, 64, 16, 0, 0, None, id="no-forced-blocks-rows-shorter-than-k"),
    pytest.param(1, 1, 300, 16, 16, 3, 1, 0, None, id="nkb19-not-power-of-two"),
]


@pytest.mark.parametrize("B,HKV,N,BQ,BK,top_k,window,sinks,seq_lens", CASES)
def test_topk_kernel_picks_the_reference_blocks(B, HKV, N, BQ, BK, top_k, window, sinks, seq_lens):
    geom = selection_geometry(N, BQ, BK, top_k, window, sinks)
    scores = _scores(B, HKV, geom.num_q_blocks, geom.num_k_blocks, seed=N)
    got = triton_selection_candidates(scores, geom, window=window, sinks=sinks)
    ref = selection_candidates(scores, geom, window=window, sinks=sinks)
    assert got.dtype == torch.int64 and got.shape == ref.shape
    assert torch.equal(_sorted(got), _sorted(ref))
    assert (got == -1).any() == (ref == -1).any()


def test_topk_kernel_ranks_empty_blocks_last_and_breaks_their_ties_by_block():
    """Blocks past seq_lens are picked only when nothing else is left; among them (all the same score) the
    lower blocks first. The reference picks the same real blocks and as many empty ones (torch.topk ranks
    the tied empty blocks in no fixed order)."""
    B, HKV, N, BQ, BK, top_k = 2, 2, 640, 64, 64, 6
    geom = selection_geometry(N, BQ, BK, top_k, 1, 1)
    scores = _scores(B, HKV, geom.num_q_blocks, geom.num_k_blocks, seed=3)
    lens = torch.tensor([640, 200], device=DEV)
    got = triton_selection_candidates(scores, geom, window=1, sinks=1, seq_lens=lens)
    ref = selection_candidates(scores, geom, window=1, sinks=1, seq_lens=lens)
    empty_from = (lens.view(B, 1, 1, 1) + BK - 1) // BK  # first key block without a valid key
    real_got = torch.where((got >= 0) & (got < empty_from), got, -1)
    real_ref = torch.where((ref >= 0) & (ref < empty_from), ref, -1)
    assert torch.equal(_sorted(real_got), _sorted(real_ref))
    assert torch.equal((got >= empty_from).sum(-1), (ref >= empty_from).sum(-1))
    # row of query block 9 in batch 1: real allowed blocks 1..3 minus window/sink -> blocks 1, 2, 3 (3 real) + empties
    row = got[1, 0, 9]
    real = row[(row >= 0) & (row < 4)]
    empties = row[row >= 4]
    assert sorted(real.tolist()) == [1, 2, 3]
    assert empties.tolist() == [4, 5, 6]  # the lowest empty blocks, in order


def test_topk_kernel_rows_of_listed_query_blocks():
    geom = selection_geometry(2048, 64, 64, 5, 2, 1)
    scores = _scores(1, 2, geom.num_q_blocks, geom.num_k_blocks, seed=7)
    blocks = torch.tensor([31, 0, 17, 5], device=DEV)
    got = triton_selection_candidates(scores[:, :, blocks], geom, window=2, sinks=1, query_blocks=blocks)
    full = triton_selection_candidates(scores, geom, window=2, sinks=1)
    assert torch.equal(got, full[:, :, blocks])
    ref = selection_candidates(scores[:, :, blocks], geom, window=2, sinks=1, query_blocks=blocks)
    assert torch.equal(_sorted(got), _sorted(ref))


def test_topk_kernel_nan_scores_rank_first():
    geom = selection_geometry(512, 64, 64, 2, 1, 0)
    scores = _scores(1, 1, geom.num_q_blocks, geom.num_k_blocks, seed=1)
    scores[0, 0, 7, 3] = float("nan")
    got = triton_selection_candidates(scores, geom, window=1, sinks=0)
    ref = selection_candidates(scores, geom, window=1, sinks=0)
    assert 3 in got[0, 0, 7].tolist() and 3 in ref[0, 0, 7].tolist()
    assert torch.equal(_sorted(got), _sorted(ref))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda s, g: triton_selection_candidates(s[0], g, window=1, sinks=0), r"scores must be \[B, HKV, R, NKB=8\]"),
        (lambda s, g: triton_selection_candidates(s[..., :5], g, window=1, sinks=0), r"NKB=8"),
        (
            lambda s, g: triton_selection_candidates(s, g, window=1, sinks=0, seq_lens=torch.tensor([3, 4])),
            r"seq_lens must be \[B\]",
        ),
        (
            lambda s, g: triton_selection_candidates(s, g, window=1, sinks=0, query_blocks=torch.tensor([0])),
            "query_blocks must list the 8 rows",
        ),
    ],
    ids=["3d", "wrong-nkb", "seq-lens-shape", "query-blocks-shape"],
)
def test_topk_kernel_rejects_bad_arguments(call, match):
    geom = selection_geometry(512, 64, 64, 2, 1, 0)
    scores = _scores(1, 1, geom.num_q_blocks, geom.num_k_blocks, device="cpu")
    with pytest.raises(ValueError, match=match):
        call(scores, geom)


OP_CASES = [
    # (B, HKV, N, BQ, BK, k, window, sinks, seq_lens, query blocks)
    pytest.param(2, 3, 300, 16, 16, 3, 1, 1, (300, 150), None, id="odd-heads-seq-lens"),
    pytest.param(1, 2, 147, 32, 16, 4, 0, 0, None, (4, 1, 3), id="query-blocks-unsorted-partial-last"),
]


def _op_args(B, HKV, N, BQ, BK, k, window, sinks, seq_lens, blocks):
    """(scores, seq_lens int32, query_blocks int32) and the launcher's keywords of an op case."""
    rows = len(blocks) if blocks else -(-N // BQ)
    scores = _scores(B, HKV, rows, -(-N // BK), seed=N)
    lens = None if seq_lens is None else torch.tensor(seq_lens, device=DEV, dtype=torch.int32)
    listed = None if blocks is None else torch.tensor(blocks, device=DEV, dtype=torch.int32)
    return scores, lens, listed, dict(seq_len=N, block_q=BQ, block_k=BK, k=k, window=window, sinks=sinks)


@pytest.mark.parametrize("B,HKV,N,BQ,BK,k,window,sinks,seq_lens,blocks", OP_CASES)
def test_selection_topk_op_passes_opcheck(B, HKV, N, BQ, BK, k, window, sinks, seq_lens, blocks):
    """The op's schema, fake (shape, dtype, strides) and AOT dispatch."""
    scores, lens, listed, _ = _op_args(B, HKV, N, BQ, BK, k, window, sinks, seq_lens, blocks)
    args = (scores, lens, listed, N, BQ, BK, k, window, sinks)
    torch.library.opcheck(torch.ops.sparse_train.selection_topk.default, args)


@pytest.mark.parametrize("B,HKV,N,BQ,BK,k,window,sinks,seq_lens,blocks", OP_CASES)
def test_topk_blocks_compiled_fullgraph_equals_the_launcher(B, HKV, N, BQ, BK, k, window, sinks, seq_lens, blocks):
    """``topk_blocks`` compiled with fullgraph runs the kernel through the op: the launcher's picks."""
    scores, lens, listed, meta = _op_args(B, HKV, N, BQ, BK, k, window, sinks, seq_lens, blocks)

    def picks(scores):
        return topk_blocks(scores, seq_lens=lens, query_blocks=listed, **meta)

    assert torch.equal(
        compiled_fullgraph(picks)(scores), topk_launch(scores, seq_lens=lens, query_blocks=listed, **meta)
    )


@pytest.mark.gpu
def test_selection_candidates_take_the_kernel_on_gpu(monkeypatch):
    """At 64K (P64, 8 KV heads) the CUDA path is the kernel and picks what the PyTorch path picks."""
    import sparse_train.selection.scorer as scorer_mod

    geom = selection_geometry(65536, 64, 64, 16, 8, 1)
    scores = _scores(1, 8, geom.num_q_blocks, geom.num_k_blocks, seed=11, device="cuda")
    lens = torch.tensor([60000], device="cuda")
    got = selection_candidates(scores, geom, window=8, sinks=1, seq_lens=lens)
    monkeypatch.setattr(scorer_mod, "_topk_kernel_runs", lambda *a: False)
    ref = selection_candidates(scores, geom, window=8, sinks=1, seq_lens=lens)
    empty_from = -(-60000 // 64)
    real = lambda p: _sorted(torch.where((p >= 0) & (p < empty_from), p, -1))  # noqa: E731
    assert torch.equal(real(got), real(ref))
    assert torch.equal((got >= empty_from).sum(-1), (ref >= empty_from).sum(-1))


@pytest.mark.parametrize("spread", [10.0, 40.0], ids=["spread10", "spread40"])
def test_top_p_one_takes_the_kernel_and_picks_what_none_picks(monkeypatch, spread):
    """Where the kernel runs, top_p = 1.0 (no budget cut) runs it too and picks exactly the blocks of top_p = None,
    on the peaked scores of a confident selector."""
    import sparse_train.selection.scorer as scorer_mod

    monkeypatch.setattr(scorer_mod, "_topk_kernel_runs", lambda *a: True)
    geom = selection_geometry(320, 16, 16, 6, 1, 1)
    scores = torch.randn(2, 2, geom.num_q_blocks, geom.num_k_blocks, generator=torch.Generator().manual_seed(0))
    scores = (scores * spread).to(DEV)
    lens = torch.tensor([320, 200], device=DEV)
    none = selection_candidates(scores, geom, window=1, sinks=1, seq_lens=lens)
    one = selection_candidates(scores, geom, window=1, sinks=1, seq_lens=lens, top_p=1.0)
    assert torch.equal(one, none)
