"""The candidate index-score kernels (kernels/triton/index_candidates.py) against their PyTorch references
(kernels/reference/index_candidates.py) in float64, by the error-ratio rule: the bounds of every block pair and the
exact scores of listed blocks; odd lengths, unequal blocks, E in {1, 2, 3, 4}, S in {8, 16, 20, 32}, seq_lens with
NaN padding, packed documents (a boundary inside a block), listed query blocks (unsorted, the partial last block), an
all-masked row, unlisted slots (-1, past NKB), repeated blocks, any strides, float16, dispatch and validation; the
custom ops ``sparse_train::index_score_bounds`` and ``sparse_train::candidate_index_scores`` (opcheck, a fullgraph
compile against eager) and ``candidate_blocks`` compiled with the top-k kernel's op.
GPU-marked tests: bf16 at N = 16384 with H in {1, 3, 4, 8}, 128K on listed query blocks, no host sync and CUDA-graph
capture."""

import pytest
import torch
from builders import (
    assert_sync_free_and_capturable,
    check_close,
    compile_report_in_subprocess,
    compiled_fullgraph,
    ids_from_lengths,
    index_inputs,
    ptxas_path,
    ptxas_usage,
    warmup_for_hopper,
)

from sparse_train.kernels.reference.index_candidates import (
    reference_candidate_index_scores,
    reference_index_score_bounds,
)
from sparse_train.kernels.reference.index_scores import reference_index_block_scores
from sparse_train.kernels.triton.index_candidates import candidate_index_scores, index_score_bounds

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "auto" if DEV == "cuda" else "triton"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh float outputs start as NaN


def _inputs(*args, device=DEV, **kwargs):
    return index_inputs(*args, device=device, **kwargs)


def _listed(B, H, R, NKB, C, seed):
    """int64 ``[B, H, R, C]`` random key-block ids with an unlisted slot (-1), an id past NKB and a repeated id."""
    g = torch.Generator().manual_seed(seed)
    listed = torch.randint(0, NKB, (B, H, R, C), generator=g)
    listed[..., 0] = -1
    if C > 2:
        listed[..., 1] = NKB + 3
        listed[..., 2] = listed[..., 3 % C]
    return listed


CASES = [
    # (B, H, N, E, S, BQ, BK, seq_lens, document lengths per row, query blocks)
    pytest.param(2, 2, 147, 2, 16, 32, 16, None, None, None, id="odd-n-bq32-bk16-e2-s16"),
    pytest.param(1, 3, 100, 1, 32, 16, 32, None, None, None, id="bq16-bk32-e1-s32"),
    pytest.param(2, 1, 150, 4, 16, 16, 16, (150, 77), None, None, id="e4-seq-lens-nan-padding"),
    pytest.param(2, 2, 131, 2, 16, 32, 32, (131, 120), ((40, 31, 60), (70, 61)), None, id="documents-inside-blocks"),
    pytest.param(2, 2, 147, 2, 16, 32, 16, (147, 100), None, (4, 1, 3), id="query-blocks-unsorted-partial-last"),
    pytest.param(1, 2, 147, 2, 32, 32, 32, None, ((20, 90, 37),), (2, 0, 4), id="query-blocks-documents"),
    pytest.param(1, 2, 90, 3, 20, 16, 16, None, None, None, id="e3-s20-padded-tile"),
    pytest.param(1, 1, 70, 1, 8, 16, 16, None, None, None, id="s8-padded-to-16"),
    pytest.param(2, 1, 120, 2, 16, 16, 32, (0, 120), None, None, id="all-masked-row"),
    pytest.param(1, 2, 300, 1, 16, 64, 64, (271,), None, None, id="bq64-bk64-partial-last"),
]


def _kwargs(N, BQ, BK, seq_lens, docs, blocks, device=DEV):
    return {
        "block_q": BQ,
        "block_k": BK,
        "seq_lens": None if seq_lens is None else torch.tensor(seq_lens, device=device),
        "document_ids": None if docs is None else ids_from_lengths(*docs).to(device),
        "query_blocks": None if blocks is None else torch.tensor(blocks, device=device),
    }


@pytest.mark.parametrize("B,H,N,E,S,BQ,BK,seq_lens,docs,blocks", CASES)
def test_bounds_match_reference(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks):
    u, w = _inputs(B, H, N, E, S, blocks=blocks, block_q=BQ, seed=N + E, seq_lens=seq_lens)
    kwargs = _kwargs(N, BQ, BK, seq_lens, docs, blocks)
    got = index_score_bounds(u, w, backend=BACKEND, **kwargs)
    ref = reference_index_score_bounds(u.double(), w.double(), **kwargs)
    low = reference_index_score_bounds(u, w, **kwargs)
    R = len(blocks) if blocks else -(-N // BQ)
    assert got.shape == (B, H, R, -(-N // BK)) and got.dtype == torch.float32
    assert not got.isnan().any(), "an element of the bounds was left unwritten"
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), "the -inf pattern differs from the reference"
    finite = torch.isfinite(ref)
    check_close("bounds", got[finite], ref[finite], low[finite], torch.float32)
    exact = reference_index_block_scores(u.double(), w.double(), **kwargs)
    scored = torch.isfinite(exact)
    assert (ref[scored] >= exact[scored] - 1e-9 * exact[scored].abs().clamp(min=1)).all(), "a bound below its score"


@pytest.mark.parametrize("B,H,N,E,S,BQ,BK,seq_lens,docs,blocks", CASES)
def test_candidate_scores_match_reference(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks):
    u, w = _inputs(B, H, N, E, S, blocks=blocks, block_q=BQ, seed=N + S, seq_lens=seq_lens)
    kwargs = _kwargs(N, BQ, BK, seq_lens, docs, blocks)
    R, NKB = (len(blocks) if blocks else -(-N // BQ)), -(-N // BK)
    listed = _listed(B, H, R, NKB, 5, seed=N).to(DEV)
    got = candidate_index_scores(u, w, listed, backend=BACKEND, **kwargs)
    ref = reference_candidate_index_scores(u.double(), w.double(), listed, **kwargs)
    low = reference_candidate_index_scores(u, w, listed, **kwargs)
    assert got.shape == (B, H, R, 5) and got.dtype == torch.float32
    assert not got.isnan().any(), "an element of the scores was left unwritten"
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), "the -inf pattern differs from the reference"
    assert torch.all(got[..., :2] == float("-inf")), "an unlisted slot (-1, past NKB) has a score"
    assert torch.equal(got[..., 2], got[..., 3]), "a repeated block scores differently"
    finite = torch.isfinite(ref)
    check_close("candidate scores", got[finite], ref[finite], low[finite], torch.float32)
    # the same pairs of the full reference
    full = reference_index_block_scores(u.double(), w.double(), **kwargs)
    in_range = (listed >= 0) & (listed < NKB)
    same = full.gather(-1, listed.clamp(0, NKB - 1))[in_range]
    assert torch.equal(torch.isfinite(ref[in_range]), torch.isfinite(same))
    finite = torch.isfinite(same)
    assert torch.allclose(ref[in_range][finite], same[finite], rtol=1e-12, atol=1e-12)


def test_fp16_match_reference():
    """float16 through the interpreter (bf16 only on the GPU), against float16 inputs summed in float32 by PyTorch."""
    B, H, N, E, S, BQ, BK = 1, 2, 147, 2, 32, 32, 16
    u, w = _inputs(B, H, N, E, S, seed=3, dtype=torch.float16, seq_lens=(140,))
    kwargs = {"block_q": BQ, "block_k": BK, "seq_lens": torch.tensor([140], device=DEV)}
    bounds = index_score_bounds(u, w, backend=BACKEND, **kwargs)
    ref, low = (reference_index_score_bounds(u.to(dt), w.to(dt), **kwargs) for dt in (torch.float64, torch.float16))
    finite = torch.isfinite(ref)
    check_close("bounds fp16", bounds[finite], ref[finite], low[finite], torch.float16)
    listed = ref.topk(3, dim=-1).indices
    got = candidate_index_scores(u, w, listed, backend=BACKEND, **kwargs)
    ref_c, low_c = (
        reference_candidate_index_scores(u.to(dt), w.to(dt), listed, **kwargs) for dt in (torch.float64, torch.float16)
    )
    finite = torch.isfinite(ref_c)
    check_close("candidate scores fp16", got[finite], ref_c[finite], low_c[finite], torch.float16)


def test_kernels_read_any_strides():
    u, w = _inputs(2, 2, 100, 2, 16, seed=5)
    u_t = u.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    kwargs = {"block_q": 16, "block_k": 16}
    bounds = index_score_bounds(u, w, backend=BACKEND, **kwargs)
    assert torch.equal(index_score_bounds(u_t, w_t, backend=BACKEND, **kwargs), bounds)
    listed = bounds.topk(4, dim=-1).indices
    listed_t = listed.transpose(2, 3).contiguous().transpose(2, 3).to(torch.int32)
    got = candidate_index_scores(u, w, listed, backend=BACKEND, **kwargs)
    assert torch.equal(candidate_index_scores(u_t, w_t, listed_t, backend=BACKEND, **kwargs), got)


def test_candidate_scores_with_autograd_take_the_reference():
    """``"auto"`` with autograd on returns the reference's differentiable scores; ``"triton"`` refuses."""
    u, w = _inputs(1, 1, 64, 1, 16, seed=6)
    u.requires_grad_()
    listed = torch.tensor([[[[0], [1], [0], [3]]]], device=DEV)
    scores = candidate_index_scores(u, w, listed, block_q=16, block_k=16)
    assert scores.requires_grad
    (du,) = torch.autograd.grad(scores[torch.isfinite(scores)].sum(), (u,))
    assert torch.isfinite(du).all() and du.abs().sum() > 0
    with pytest.raises(ValueError, match="no backward"):
        candidate_index_scores(u, w, listed, block_q=16, block_k=16, backend="triton")
    bounds = index_score_bounds(u, w, block_q=16, block_k=16)
    assert not bounds.requires_grad


@pytest.mark.parametrize("which", ["bounds", "candidates"])
def test_empty_batch_is_empty(which):
    u, w = _inputs(0, 2, 40, 1, 16, seed=7)
    kwargs = {"block_q": 16, "block_k": 16, "backend": BACKEND}
    if which == "bounds":
        assert index_score_bounds(u, w, **kwargs).shape == (0, 2, 3, 3)
    else:
        listed = torch.zeros(0, 2, 3, 2, dtype=torch.int64, device=DEV)
        assert candidate_index_scores(u, w, listed, **kwargs).shape == (0, 2, 3, 2)


@pytest.mark.parametrize(
    "listed,match",
    [
        pytest.param(lambda: torch.zeros(1, 1, 4, dtype=torch.int64), "candidates must be", id="rank-3"),
        pytest.param(lambda: torch.zeros(1, 1, 3, 2, dtype=torch.int64), "candidates must be", id="rows-differ"),
        pytest.param(lambda: torch.zeros(1, 1, 4, 2), "candidates must be", id="float"),
        pytest.param(lambda: [[[[0]]]], "candidates must be", id="a-list"),
    ],
)
def test_candidate_scores_reject_bad_candidates(listed, match):
    u, w = _inputs(1, 1, 64, 1, 16, seed=8)
    value = listed()
    if isinstance(value, torch.Tensor):
        value = value.to(DEV)
    with pytest.raises(ValueError, match=match):
        candidate_index_scores(u, w, value, block_q=16, block_k=16, backend=BACKEND)


def test_bad_backend_and_block_are_named():
    u, w = _inputs(1, 1, 64, 1, 16, seed=9)
    with pytest.raises(ValueError, match="backend"):
        index_score_bounds(u, w, block_q=16, block_k=16, backend="cuda")
    with pytest.raises(ValueError, match="block_k must be one of"):
        index_score_bounds(u, w, block_q=16, block_k=24)


def test_auto_backend_takes_the_reference_on_cpu(monkeypatch):
    """On CPU ``"auto"`` runs the reference (the interpreter is for tests): the launchers are never called."""
    if DEV == "cuda":
        pytest.skip("CPU dispatch")
    from sparse_train.kernels.triton import index_candidates

    def fail(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(index_candidates, "index_score_bounds_launch", fail)
    monkeypatch.setattr(index_candidates, "candidate_index_scores_launch", fail)
    u, w = _inputs(1, 1, 64, 1, 16, seed=10)
    bounds = index_score_bounds(u, w, block_q=16, block_k=16)
    candidate_index_scores(u, w, bounds.topk(2, dim=-1).indices, block_q=16, block_k=16)


# ---------------------------------------------------------------------------------------------- custom ops
OP_CASES = [
    # (B, H, N, E, S, BQ, BK, seq_lens, document lengths per row, query blocks)
    pytest.param(2, 3, 37, 2, 16, 16, 16, (37, 20), None, None, id="odd-n-e2-seq-lens"),
    pytest.param(2, 1, 45, 1, 20, 16, 32, (45, 30), ((20, 25), (10, 35)), (2, 0), id="s20-documents-query-blocks"),
]


def _op_inputs(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks):
    """(u, w, candidates [B, H, R, 3] with an unlisted slot, seq_lens, document_ids, query_blocks) of an op case."""
    u, w = _inputs(B, H, N, E, S, blocks=blocks, block_q=BQ, seed=N + S, seq_lens=seq_lens)
    kwargs = _kwargs(N, BQ, BK, seq_lens, docs, blocks)
    rows = len(blocks) if blocks else -(-N // BQ)
    listed = _listed(B, H, rows, -(-N // BK), 3, seed=N).to(DEV)
    return u, w, listed, kwargs["seq_lens"], kwargs["document_ids"], kwargs["query_blocks"]


@pytest.mark.parametrize("B,H,N,E,S,BQ,BK,seq_lens,docs,blocks", OP_CASES)
def test_index_candidate_ops_pass_opcheck(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks):
    """Both ops' schema, fake (shape, dtype, strides) and AOT dispatch."""
    u, w, listed, lens, ids, query_blocks = _op_inputs(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks)
    torch.library.opcheck(torch.ops.sparse_train.index_score_bounds.default, (u, w, lens, query_blocks, BQ, BK))
    torch.library.opcheck(
        torch.ops.sparse_train.candidate_index_scores.default, (u, w, listed, lens, ids, query_blocks, BQ, BK)
    )


@pytest.mark.parametrize("B,H,N,E,S,BQ,BK,seq_lens,docs,blocks", OP_CASES)
def test_index_candidate_ops_compiled_fullgraph_equal_eager(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks):
    """A fullgraph-compiled function of both ops gives the eager public functions' results bit for bit."""
    u, w, listed, lens, ids, query_blocks = _op_inputs(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks)

    def bounds_and_scores(u, w, listed):
        bounds = torch.ops.sparse_train.index_score_bounds(u, w, lens, query_blocks, BQ, BK)
        exact = torch.ops.sparse_train.candidate_index_scores(u, w, listed, lens, ids, query_blocks, BQ, BK)
        return bounds, exact

    kwargs = dict(block_q=BQ, block_k=BK, seq_lens=lens, document_ids=ids, query_blocks=query_blocks, backend=BACKEND)
    got = compiled_fullgraph(bounds_and_scores)(u, w, listed)
    assert torch.equal(got[0], index_score_bounds(u, w, **kwargs))
    assert torch.equal(got[1], candidate_index_scores(u, w, listed, **kwargs))


def test_index_candidate_public_functions_compiled_fullgraph_equal_eager():
    """Both public functions (checks, dispatch) compiled with fullgraph: the eager results. (Without seq_lens,
    documents and listed blocks: their values are checked on the CPU, a host read.)"""
    u, w = _inputs(1, 2, 37, 2, 16, seed=9)

    def bounds_and_scores(u, w):
        bounds = index_score_bounds(u, w, block_q=16, block_k=16, backend=BACKEND)
        listed = bounds.topk(2, dim=-1).indices
        return bounds, candidate_index_scores(u, w, listed, block_q=16, block_k=16, backend=BACKEND)

    for got, want in zip(compiled_fullgraph(bounds_and_scores)(u, w), bounds_and_scores(u, w)):
        assert torch.equal(got, want)


def test_candidate_blocks_compiled_fullgraph_takes_the_topk_op(monkeypatch):
    """``selection/candidates.candidate_blocks`` where the kernels run, compiled with fullgraph: the top-k kernel's
    custom op in the graph (the bounds of CPU tensors take the reference under ``backend="auto"``), the eager picks."""
    import sparse_train.selection.candidates as candidates
    from sparse_train.selection import selection_geometry

    B, H, N, BQ, BK, C = 2, 2, 147, 32, 16, 4
    u, w = _inputs(B, H, N, 2, 16, seed=1)
    geometry = selection_geometry(N, BQ, BK, 2, 1, 1)
    monkeypatch.setattr(candidates, "triton_runs_on", lambda x: True)  # the interpreter runs the kernel on CPU

    def picks(u, w):
        return candidates.candidate_blocks(u, w, geometry, C, window=1, sinks=1)

    assert torch.equal(compiled_fullgraph(picks)(u, w), picks(u, w))


# ---------------------------------------------------------------------------------------------- GPU
def _check_gpu(u, w, listed_count, **kwargs):
    bounds = index_score_bounds(u, w, **kwargs)
    ref = reference_index_score_bounds(u.double(), w.double(), **kwargs)
    low = reference_index_score_bounds(u.float(), w.float(), **kwargs)
    assert torch.equal(torch.isfinite(bounds), torch.isfinite(ref))
    finite = torch.isfinite(ref)
    check_close("bounds", bounds[finite], ref[finite], low[finite], u.dtype)
    listed = ref.topk(listed_count, dim=-1).indices
    listed[..., -1] = -1
    got = candidate_index_scores(u, w, listed, **kwargs)
    ref_c = reference_candidate_index_scores(u.double(), w.double(), listed, **kwargs)
    low_c = reference_candidate_index_scores(u.float(), w.float(), listed, **kwargs)
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref_c))
    finite = torch.isfinite(ref_c)
    check_close("candidate scores", got[finite], ref_c[finite], low_c[finite], u.dtype)


@pytest.mark.parametrize(
    "N,BQ,BK,C,window,sinks,seq_lens,blocks",
    [
        pytest.param(147, 32, 16, 4, 1, 1, None, None, id="bq32-bk16-window1-sink1"),
        pytest.param(300, 16, 16, 6, 2, 3, (300, 140), None, id="window2-sinks3-seq-lens"),
        pytest.param(200, 16, 16, 5, 0, 0, (200, 0), None, id="no-forced-empty-row"),
        pytest.param(147, 32, 16, 4, 1, 1, (147, 100), (4, 1, 3), id="query-blocks-unsorted-partial-last"),
        pytest.param(64, 16, 16, 8, 1, 1, None, None, id="fewer-dynamic-blocks-than-c"),
    ],
)
def test_candidate_blocks_kernel_path_picks_what_the_reference_path_picks(
    monkeypatch, N, BQ, BK, C, window, sinks, seq_lens, blocks
):
    """selection/candidates.candidate_blocks where the kernels run (the bound kernel, then the selection's top-k kernel,
    which applies window, sinks, causality and the listed query blocks itself) picks the same set of blocks per row as
    its PyTorch path (masked bounds, torch.topk), -1 in the same number of slots."""
    import sparse_train.selection.candidates as candidates
    from sparse_train.selection import selection_geometry

    B, H = 2, 2
    u, w = _inputs(B, H, N, 2, 16, blocks=blocks, block_q=BQ, seed=N + C, seq_lens=seq_lens)
    kwargs = _kwargs(N, BQ, BK, seq_lens, None, blocks)
    del kwargs["block_q"], kwargs["block_k"]
    geometry = selection_geometry(N, BQ, BK, 2, window, sinks)
    monkeypatch.setattr(candidates, "triton_runs_on", lambda x: False)
    want = candidates.candidate_blocks(u, w, geometry, C, window=window, sinks=sinks, **kwargs)
    monkeypatch.setattr(candidates, "triton_runs_on", lambda x: True)  # the interpreter runs them on CPU
    got = candidates.candidate_blocks(u, w, geometry, C, window=window, sinks=sinks, **kwargs)
    assert got.shape == want.shape == (B, H, len(blocks) if blocks else -(-N // BQ), min(C, geometry.num_k_blocks))
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert (want >= 0).any() and (want < 0).any()  # rows with picks and rows with empty slots both occur


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 3, 4, 8])
def test_gpu_bf16_real_sizes(heads):
    """N = 16384, B = 2: row 0 packs three documents (boundaries inside blocks), row 1 is cut by seq_lens with NaN
    padding; 16 candidates per row."""
    B, N, E, S = 2, 16384, 1, 32
    lens = (N, N - 1001)
    u, w = _inputs(B, heads, N, E, S, seed=heads, dtype=torch.bfloat16, device="cuda", seq_lens=lens)
    docs = ids_from_lengths((N // 3 + 17, N // 2, N - N // 3 - 17 - N // 2), (N,)).cuda()
    _check_gpu(u, w, 16, block_q=64, block_k=64, seq_lens=torch.tensor(lens, device="cuda"), document_ids=docs)


@pytest.mark.gpu
def test_gpu_128k_on_listed_query_blocks():
    """128K (B = 1, H = 2, E = 2): both kernels on listed query blocks (the first, the last, inside) against the
    references, and the listed rows equal the full kernel's rows bit for bit."""
    N, H, E, S, P = 131072, 2, 2, 32, 64
    u, w = _inputs(1, H, N, E, S, seed=128, dtype=torch.bfloat16, device="cuda")
    blocks = torch.tensor([2047, 0, 1000, 1500, 2046], device="cuda")
    rows = (blocks.view(-1, 1) * P + torch.arange(P, device="cuda")).reshape(-1)
    u_blocks = u[:, :, rows].contiguous()
    _check_gpu(u_blocks, w, 32, block_q=P, block_k=P, query_blocks=blocks)
    full = index_score_bounds(u, w, block_q=P, block_k=P)
    assert torch.equal(full[:, :, blocks], index_score_bounds(u_blocks, w, block_q=P, block_k=P, query_blocks=blocks))


@pytest.mark.gpu
def test_gpu_candidate_blocks_kernel_path_at_16k():
    """N = 16384, float32 index vectors (no ties), seq_lens cutting row 1, listed query blocks: the kernel path of
    selection/candidates.candidate_blocks picks the PyTorch path's blocks."""
    import sparse_train.selection.candidates as candidates
    from sparse_train.selection import selection_geometry

    N, H, P, C = 16384, 4, 64, 32
    lens = torch.tensor([N, 9000], device="cuda")
    u, w = _inputs(2, H, N, 1, 32, seed=16, device="cuda", seq_lens=(N, 9000))
    geometry = selection_geometry(N, P, P, 16, 8, 1)
    for blocks in (None, torch.tensor([255, 3, 140, 200], device="cuda")):
        rows = u if blocks is None else u[:, :, (blocks.view(-1, 1) * P + torch.arange(P, device="cuda")).reshape(-1)]
        kwargs = dict(window=8, sinks=1, seq_lens=lens, query_blocks=blocks)
        got = candidates.candidate_blocks(rows, w, geometry, C, **kwargs)
        bounds = candidates.dynamic_block_bounds(rows, w, geometry, **kwargs)
        top = bounds.topk(C, dim=-1)
        want = torch.where(torch.isneginf(top.values), -1, top.indices)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
        assert (want < 0).any() and (want >= 0).all(-1).any()


@pytest.mark.gpu
def test_gpu_never_synchronises_and_captures():
    """Neither kernel makes a device -> host synchronisation, with seq_lens, documents and listed query blocks; both
    capture in a CUDA graph whose replay gives the eager results."""
    N, H, E, S, P = 4097, 4, 2, 32, 64
    u, w = _inputs(2, H, N, E, S, seed=2, dtype=torch.bfloat16, device="cuda", seq_lens=(N, 3000))
    kwargs = {
        "block_q": P,
        "block_k": P,
        "seq_lens": torch.tensor([N, 3000], device="cuda"),
        "document_ids": ids_from_lengths((1000, N - 1000), (N,)).cuda(),
    }

    def run():
        bounds = index_score_bounds(u, w, **kwargs)
        return bounds, candidate_index_scores(u, w, bounds.topk(8, dim=-1).indices, **kwargs)

    assert_sync_free_and_capturable(run)


# ---------------------------------------------------------------------------------------------- compile for Hopper
def hopper_compile_report(cases):
    """[(kernel, registers, spill store bytes)] of both kernels compiled for sm_90a at the launchers' tiles for each
    ``(E, S, with_docs_lengths_blocks)`` case (block 64, bf16). Runs in a process without the interpreter (the test
    below starts one, :func:`builders.compile_report_in_subprocess`)."""
    import triton

    from sparse_train.kernels.triton.index_candidates import (
        NUM_WARPS,
        _candidate_scores_kernel,
        _index_bounds_kernel,
        bound_key_blocks,
        candidate_tiles,
    )

    report = []
    for E, S, full in cases:
        block, N = 64, 256
        rows = max(16, triton.next_power_of_2(block * E))
        s_p2 = max(16, triton.next_power_of_2(S))
        u = torch.zeros(1, 2, N, E, S, dtype=torch.bfloat16)
        w = torch.zeros(1, 2, N, S, dtype=torch.bfloat16)
        extremes = torch.zeros(1, 2, 4, 2 * S, dtype=torch.bfloat16)
        listed = torch.zeros(1, 2, 4, 8, dtype=torch.int64)
        out, ints = torch.zeros(1, 2, 4, 4), torch.zeros(4, dtype=torch.int32)
        step, warps = candidate_tiles(block, rows)
        bounds = warmup_for_hopper(
            _index_bounds_kernel,
            u, extremes, ints, ints, out, *u.stride(), *extremes.stride(), 2, N, 4, 4, S,
            E=E, BLOCK_Q=block, BLOCK_K=block, S_P2=s_p2, ROWS=rows, KEY_BLOCKS=bound_key_blocks(rows),
            HAS_QUERY_BLOCKS=full, HAS_SEQ_LENS=full, IEEE=False, num_warps=NUM_WARPS, num_stages=2, grid=(1, 1),
        )  # fmt: skip
        candidates = warmup_for_hopper(
            _candidate_scores_kernel,
            u, w, listed, ints, ints, ints, out, *u.stride(), *w.stride(), *listed.stride(), 2, N, 4, 4, 8, S,
            E=E, BLOCK_Q=block, BLOCK_K=block, S_P2=s_p2, ROWS=rows, STEP=step, HAS_QUERY_BLOCKS=full,
            HAS_SEQ_LENS=full, HAS_DOCS=full, IEEE=False, num_warps=warps, num_stages=2, grid=(1, 1),
        )  # fmt: skip
        report += [("bounds", *ptxas_usage(bounds)), ("candidates", *ptxas_usage(candidates))]
    return report


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
def test_kernels_compile_for_hopper_without_spills():
    """The interpreter accepts programs the compiler rejects (a bf16 operand next to an fp32 one): both kernels
    compile for sm_90a at the launchers' tiles, with documents, lengths and listed query blocks and without, for
    E in {1, 2, 4} and S in {16, 32, 64}, without register spills."""
    if ptxas_path() is None:
        pytest.skip("this triton ships no ptxas")
    cases = [(1, 32, False), (1, 32, True), (2, 32, True), (4, 16, True), (1, 64, True)]
    report = compile_report_in_subprocess(__file__, "hopper_compile_report", cases)
    for (E, S, full), pair in zip(cases, zip(report[0::2], report[1::2])):
        for name, registers, spills in pair:
            print(f"E={E} S={S} full={full} {name}: {registers} registers, {spills} bytes spilled")
            assert spills == 0, (E, S, full, name)
