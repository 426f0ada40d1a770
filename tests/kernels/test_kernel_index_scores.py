"""The index block-scores kernel (kernels/index_scores.py) against its PyTorch reference
(kernels/reference_index_scores.py) in float64, by the error-ratio rule: the scores and the gradients of u and w;
odd lengths, unequal blocks, E in {1, 2, 3, 4}, S in {16, 20, 32}, seq_lens with NaN padding, packed documents
(a boundary inside a block), listed query blocks (unsorted, the partial last block), an all-masked row, tile
options, determinism, the winners the kernel stores, validation and dispatch; the custom ops
(``sparse_train::index_block_scores`` and its backward: opcheck, a fullgraph compile against eager, the public
function's path under a dispatch mode). GPU-marked tests: bf16 / fp16 at
N = 4097 and 16384 with H in {1, 3, 4, 8}, and 128K on listed query blocks."""

import pytest
import torch
from builders import (
    OpRecorder,
    check_close,
    compile_report_in_subprocess,
    compiled_fullgraph,
    ids_from_lengths,
    index_inputs,
    ptxas_path,
    ptxas_usage,
    rel_err,
    warmup_for_hopper,
)

from sparse_train.kernels.reference.index_scores import (
    check_index_score_args,
    reference_index_block_scores,
)
from sparse_train.kernels.triton import index_scores as index_scores_mod
from sparse_train.kernels.triton.index_scores import (
    IndexScoreOptions,
    index_block_scores,
    index_block_scores_launch,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "auto" if DEV == "cuda" else "triton"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh float outputs start as NaN


def _inputs(*args, device=DEV, **kwargs):
    return index_inputs(*args, device=device, **kwargs)


def _reference_with_grads(u, w, grad, dtype, **kwargs):
    """(scores, du, dw) of the reference with u and w cast to ``dtype``."""
    u_ = u.detach().to(dtype).requires_grad_()
    w_ = w.detach().to(dtype).requires_grad_()
    scores = reference_index_block_scores(u_, w_, **kwargs)
    du, dw = torch.autograd.grad(scores, (u_, w_), grad.to(scores.dtype))
    return scores, du, dw


def _finite(x):
    """NaN padding of the inputs carries no gradient: compare gradients where the inputs are real."""
    return torch.nan_to_num(x.double(), nan=0.0)


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
]


@pytest.mark.parametrize("B,H,N,E,S,BQ,BK,seq_lens,docs,blocks", CASES)
def test_index_scores_match_reference(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks):
    u, w = _inputs(B, H, N, E, S, blocks=blocks, block_q=BQ, seed=N + E, seq_lens=seq_lens)
    kwargs = {
        "block_q": BQ,
        "block_k": BK,
        "seq_lens": None if seq_lens is None else torch.tensor(seq_lens, device=DEV),
        "document_ids": None if docs is None else ids_from_lengths(*docs).to(DEV),
        "query_blocks": None if blocks is None else torch.tensor(blocks, device=DEV),
    }
    u.requires_grad_()
    w.requires_grad_()
    got = index_block_scores(u, w, backend=BACKEND, **kwargs)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(7)).to(DEV)
    du, dw = torch.autograd.grad(got, (u, w), grad)
    ref, ref_du, ref_dw = _reference_with_grads(u, w, grad, torch.float64, **kwargs)
    low, low_du, low_dw = _reference_with_grads(u, w, grad, torch.float32, **kwargs)
    nkb = -(-N // BK)
    assert got.shape == (B, H, len(blocks) if blocks else -(-N // BQ), nkb) and got.dtype == torch.float32
    assert not got.isnan().any(), "an element of the scores was left unwritten"
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), "the -inf pattern differs from the reference"
    check_close("scores", got, ref, low, torch.float32)
    check_close("grad u", _finite(du), _finite(ref_du), _finite(low_du), torch.float32)
    check_close("grad w", _finite(dw), _finite(ref_dw), _finite(low_dw), torch.float32)
    if blocks is None:
        for b, length in enumerate(seq_lens or (N,) * B):
            assert torch.all(du[b, :, length:] == 0) and torch.all(dw[b, :, length:] == 0), "padding got a gradient"
            first_dead = -(-length // BQ)
            assert torch.all(got[b, :, first_dead:] == float("-inf")), "a block past seq_lens has a score"


def test_index_scores_fp16_match_reference():
    """float16 inputs through the interpreter (bf16 only on the GPU): error vs fp64 within the error-ratio rule
    against the same float16 inputs summed in float32 by PyTorch."""
    B, H, N, E, S, BQ, BK = 1, 2, 147, 2, 32, 32, 16
    u, w = _inputs(B, H, N, E, S, seed=3, dtype=torch.float16, seq_lens=(140,))
    kwargs = {"block_q": BQ, "block_k": BK, "seq_lens": torch.tensor([140], device=DEV)}
    u.requires_grad_()
    w.requires_grad_()
    got = index_block_scores(u, w, backend=BACKEND, **kwargs)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    du, dw = torch.autograd.grad(got, (u, w), grad)
    ref, ref_du, ref_dw = _reference_with_grads(u, w, grad, torch.float64, **kwargs)
    low, low_du, low_dw = _reference_with_grads(u, w, grad, torch.float16, **kwargs)
    assert du.dtype == dw.dtype == torch.float16
    check_close("scores fp16", got, ref, low, torch.float16)
    check_close("grad u fp16", _finite(du), _finite(ref_du), _finite(low_du), torch.float16)
    check_close("grad w fp16", _finite(dw), _finite(ref_dw), _finite(low_dw), torch.float16)


@pytest.mark.parametrize("blocks", [None, (9, 2, 5)], ids=["all-blocks", "three-listed-blocks"])
@pytest.mark.parametrize(
    "options",
    [
        IndexScoreOptions(key_tile=16, row_tile=16, num_warps=1, num_stages=1),
        IndexScoreOptions(key_tile=64, row_tile=32, num_warps=2),
        IndexScoreOptions(key_tile=256, row_tile=256, num_warps=8),
        IndexScoreOptions(blocks_per_program=2),
        IndexScoreOptions(key_tile=32, row_tile=16, blocks_per_program=2),
        IndexScoreOptions(keys_major=False),
        IndexScoreOptions(keys_major=True),
        IndexScoreOptions(key_tile=32, row_tile=16, blocks_per_program=2, keys_major=True),
    ],
    ids=[
        "one-block-16-row-slices",
        "two-blocks-32-row-slices",
        "sixteen-blocks-whole-tile",
        "pairs",
        "pairs-row-slices",
        "rows-major",
        "keys-major",
        "keys-major-pairs-row-slices",
    ],
)
def test_index_scores_tile_options_give_the_same_scores(options, blocks):
    """Key blocks per step, row slices, query blocks per program and the product's orientation change the order
    of nothing but the max:
    scores and winners equal the default tiles' bit for bit (rows of 16 * 2 = 32 per block: two slices of 16,
    one of 32 or 256; pairs of query blocks, the last one alone when their number is odd). The inputs are
    integers (|value| <= 64, so every 16-term dot product is exact in float32): a tile's product then does not
    depend on how the dot is blocked, which differs between the interpreter's BLAS calls of different shapes."""
    lens = torch.tensor([147, 101], device=DEV)
    docs = ids_from_lengths((60, 87), (30, 117)).to(DEV)
    listed = None if blocks is None else torch.tensor(blocks, device=DEV)
    u, w = _inputs(2, 2, 147, 2, 16, blocks=blocks, block_q=16, seed=5, seq_lens=(147, 101))
    u, w = ((t * 16).round().clamp(-64, 64) for t in (u, w))
    args = check_index_score_args(u, w, 16, 16, lens, docs, listed)
    common = {"seq_lens": lens, "document_ids": docs, "query_blocks": listed, "with_winner": True}
    base = index_block_scores_launch(u, w, args, **common)
    other = index_block_scores_launch(u, w, args, options=options, **common)
    for a, b in zip(base, other):
        assert torch.equal(a, b)


def test_index_scores_winners_are_valid_maxima(monkeypatch):
    """The stored winner of every finite score is a valid (row, index head, key) of its block pair whose float64
    logit is the float64 reference score; -inf scores have winner -1. Fresh int32 outputs start as a sentinel,
    so an unwritten winner fails too."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        t.fill_(float("nan") if t.is_floating_point() else 123457)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    B, H, N, E, S, BQ, BK = 2, 2, 147, 2, 16, 32, 16
    lens = torch.tensor([147, 90], device=DEV)
    docs = ids_from_lengths((50, 50, 47), (100, 47)).to(DEV)
    blocks = torch.tensor([4, 0, 2], device=DEV)
    u, w = _inputs(B, H, N, E, S, blocks=(4, 0, 2), block_q=BQ, seed=11, seq_lens=(147, 90))
    args = check_index_score_args(u, w, BQ, BK, lens, docs, blocks)
    scores, win_row, win_key = index_block_scores_launch(
        u, w, args, seq_lens=lens, document_ids=docs, query_blocks=blocks, with_winner=True
    )
    ref = reference_index_block_scores(
        u.double(), w.double(), block_q=BQ, block_k=BK, seq_lens=lens, document_ids=docs, query_blocks=blocks
    )
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores), finite)
    assert torch.all(win_row[~finite] == -1) and torch.all(win_key[~finite] == -1)
    b, h, i, j = finite.nonzero(as_tuple=True)
    m, e = win_row[finite] // E, win_row[finite] % E
    t = win_key[finite].long()
    pos = blocks[i] * BQ + m % BQ
    assert torch.all(m // BQ == i), "the winning row lies outside its query block"
    assert torch.all(t // BK == j), "the winning key lies outside its key block"
    assert torch.all((t <= pos) & (pos < lens[b]) & (docs[b, t] == docs[b, pos])), "the winner is not a valid pair"
    logit = (u.double()[b, h, m.long(), e.long()] * w.double()[b, h, t]).sum(-1)
    torch.testing.assert_close(logit, ref[finite], rtol=0, atol=1e-12)


def test_index_scores_deterministic_mode_repeats_bitwise():
    """Under torch.use_deterministic_algorithms the backward takes the sorted accumulation: two runs agree bit
    for bit, and with the default accumulation up to float32 order."""
    u, w = _inputs(1, 2, 147, 2, 16, seed=2)
    u.requires_grad_()
    w.requires_grad_()

    def grads():
        scores = index_block_scores(u, w, block_q=16, block_k=16, backend=BACKEND)
        return torch.autograd.grad(scores, (u, w), torch.ones_like(scores).masked_fill(~torch.isfinite(scores), 0))

    plain = grads()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b, c in zip(first, second, plain):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_index_scores_read_any_strides():
    """u and w as permuted views (no copy): the scores equal those of contiguous copies bit for bit."""
    g = torch.Generator().manual_seed(6)
    u_store = torch.randn(16, 2, 3, 100, 2, generator=g).to(DEV)  # [S, B, E, N, H] memory order
    w_store = torch.randn(100, 2, 2, 16, generator=g).to(DEV)  # [N, H, B, S]
    u = u_store.permute(1, 4, 3, 2, 0)  # [B, H, N, E, S]
    w = w_store.permute(2, 1, 0, 3)  # [B, H, N, S]
    assert not u.is_contiguous() and not w.is_contiguous()
    strided = index_block_scores(u, w, block_q=32, block_k=16, backend=BACKEND)
    dense = index_block_scores(u.contiguous(), w.contiguous(), block_q=32, block_k=16, backend=BACKEND)
    assert torch.equal(strided, dense)


def test_index_scores_without_grad_equal_the_autograd_path():
    u, w = _inputs(1, 2, 100, 2, 16, seed=4)
    with torch.no_grad():
        plain = index_block_scores(u, w, block_q=32, block_k=16, backend=BACKEND)
    tracked = index_block_scores(u.requires_grad_(), w, block_q=32, block_k=16, backend=BACKEND)
    assert tracked.requires_grad and not plain.requires_grad
    assert torch.equal(plain, tracked.detach())


def test_index_scores_auto_backend_takes_the_reference_on_cpu(monkeypatch):
    u, w = _inputs(1, 1, 64, 1, 16, device="cpu")
    calls = []
    monkeypatch.setattr(index_scores_mod, "index_block_scores_launch", lambda *a, **k: calls.append(1))
    got = index_block_scores(u, w, block_q=16, block_k=16)
    ref = reference_index_block_scores(u, w, block_q=16, block_k=16)
    assert not calls and torch.equal(got, ref)


def _bad_calls():
    u, w = _inputs(1, 2, 64, 2, 16, device="cpu")
    ok = {"block_q": 16, "block_k": 16}
    blocks = torch.tensor([0, 3])
    u_blocks = u[:, :, :32]
    return [
        pytest.param(lambda f: f(u[0], w, **ok), "u must be a 5-D tensor", id="u-rank"),
        pytest.param(lambda f: f(u, w[0], **ok), "w must be a 4-D tensor", id="w-rank"),
        pytest.param(lambda f: f(u.long(), w.long(), **ok), "u must have a dtype among", id="u-dtype"),
        pytest.param(lambda f: f(u, w.double(), **ok), "u and w must share a dtype", id="dtype-mismatch"),
        pytest.param(lambda f: f(u, w[..., :8], **ok), "disagree on B, H or S", id="s-mismatch"),
        pytest.param(lambda f: f(u, w[:, :1], **ok), "disagree on B, H or S", id="h-mismatch"),
        pytest.param(lambda f: f(u[:, :, :, :0], w, **ok), "u must have E >= 1", id="e-zero"),
        pytest.param(
            lambda f: f(u, w, block_q=24, block_k=16), r"block_q must be one of \(16, 32, 64, 128\)", id="block-q-24"
        ),
        pytest.param(lambda f: f(u, w, block_q=16, block_k=256), r"block_k must be one of", id="block-k-256"),
        pytest.param(lambda f: f(u[:, :, :63], w, **ok), "u must have M = N = 64 rows", id="rows-without-blocks"),
        pytest.param(
            lambda f: f(u_blocks, w, query_blocks=blocks.float(), **ok),
            "query_blocks must have an integer dtype",
            id="query-blocks-float",
        ),
        pytest.param(
            lambda f: f(u_blocks, w, query_blocks=blocks.view(1, 2), **ok),
            "query_blocks must be 1-D",
            id="query-blocks-2d",
        ),
        pytest.param(
            lambda f: f(u_blocks, w, query_blocks=torch.tensor([0, 4]), **ok),
            r"query_blocks values must lie in \[0, NQB=4\)",
            id="query-blocks-range",
        ),
        pytest.param(
            lambda f: f(u, w, query_blocks=blocks, **ok), r"len\(query_blocks\) \* block_q", id="rows-with-blocks"
        ),
        pytest.param(
            lambda f: f(u, w, seq_lens=torch.tensor([64, 64]), **ok), "seq_lens has 2 entries", id="seq-lens-shape"
        ),
        pytest.param(
            lambda f: f(u, w, seq_lens=torch.tensor([65]), **ok), "seq_lens values must lie", id="seq-lens-value"
        ),
        pytest.param(
            lambda f: f(u, w, document_ids=torch.zeros(1, 63, dtype=torch.int64), **ok),
            "document_ids must have shape",
            id="document-ids-shape",
        ),
        pytest.param(
            lambda f: f(u, w, document_ids=torch.arange(64).flip(0).view(1, 64), **ok),
            "document_ids must be non-decreasing",
            id="document-ids-decreasing",
        ),
    ]


@pytest.mark.parametrize("which", ["kernel", "reference"])
@pytest.mark.parametrize("call,match", _bad_calls())
def test_index_scores_reject_bad_arguments(call, match, which):
    """Each bad argument raises a ValueError naming it, on both paths."""
    if which == "kernel":

        def f(*a, **k):
            return index_block_scores(*a, backend=BACKEND, **k)
    else:
        f = reference_index_block_scores
    with pytest.raises(ValueError, match=match):
        call(f)


@pytest.mark.parametrize("which", ["kernel", "reference"])
def test_index_scores_of_an_empty_batch_are_empty(which):
    """B = 0: scores ``[0, H, NQB, NKB]`` and empty gradients of u and w, on both paths."""
    u, w = (t.requires_grad_() for t in _inputs(0, 2, 64, 2, 16))
    if which == "kernel":
        scores = index_block_scores(u, w, block_q=16, block_k=16, backend=BACKEND)
    else:
        scores = reference_index_block_scores(u, w, block_q=16, block_k=16)
    assert scores.shape == (0, 2, 4, 4)
    du, dw = torch.autograd.grad(scores.sum(), (u, w))
    assert (du.shape, dw.shape) == (u.shape, w.shape)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"backend": "cuda"}, "backend must be one of", id="backend"),
        pytest.param(
            {"options": IndexScoreOptions(key_tile=24)}, "options.key_tile must be a power of two", id="key-tile"
        ),
        pytest.param(
            {"options": IndexScoreOptions(row_tile=8)}, "options.row_tile must be an int >= 16", id="row-tile"
        ),
        pytest.param({"options": IndexScoreOptions(num_warps=3)}, "options.num_warps must be one of", id="warps"),
        pytest.param({"options": IndexScoreOptions(num_stages=0)}, "options.num_stages must be", id="stages"),
        pytest.param(
            {"options": IndexScoreOptions(blocks_per_program=4)},
            "options.blocks_per_program must be one of",
            id="blocks-per-program",
        ),
        pytest.param({"options": {"key_tile": 64}}, "options must be an IndexScoreOptions", id="options-dict"),
    ],
)
def test_index_scores_reject_bad_backend_and_options(kwargs, match):
    u, w = _inputs(1, 1, 64, 1, 16, device="cpu")
    with pytest.raises(ValueError, match=match):
        index_block_scores(u, w, block_q=16, block_k=16, **kwargs)


@pytest.mark.parametrize(
    "dtype,device,match",
    [
        pytest.param(torch.float64, DEV, "backend='triton' cannot run this input: dtype torch.float64", id="float64"),
        pytest.param(torch.bfloat16, "cpu", "backend='triton' cannot run this input", id="bf16-cpu"),
    ],
)
def test_index_scores_triton_backend_names_what_it_cannot_run(dtype, device, match):
    u, w = _inputs(1, 1, 64, 1, 16, dtype=dtype, device=device)
    with pytest.raises(ValueError, match=match):
        index_block_scores(u, w, block_q=16, block_k=16, backend="triton")


def test_index_scores_float64_auto_takes_the_reference():
    u, w = _inputs(1, 1, 64, 1, 16, dtype=torch.float64)
    got = index_block_scores(u, w, block_q=16, block_k=16)
    assert got.dtype == torch.float64
    assert torch.equal(got, reference_index_block_scores(u, w, block_q=16, block_k=16))


# ---------------------------------------------------------------------------------------------- custom ops
OP_CASES = [
    # (B, H, N, E, S, BQ, BK, seq_lens, document lengths per row, query blocks)
    pytest.param(2, 3, 37, 2, 16, 16, 16, (37, 20), None, None, id="odd-n-e2-seq-lens"),
    pytest.param(2, 1, 45, 1, 20, 16, 32, (45, 30), ((20, 25), (10, 35)), (2, 0), id="s20-documents-query-blocks"),
]


def _op_inputs(B, H, N, E, S, BQ, seq_lens, docs, blocks):
    """(u, w, seq_lens, document_ids, query_blocks) of an op case (NaN padding past seq_lens)."""
    u, w = _inputs(B, H, N, E, S, blocks=blocks, block_q=BQ, seed=N + S, seq_lens=seq_lens)
    return (
        u,
        w,
        None if seq_lens is None else torch.tensor(seq_lens, device=DEV),
        None if docs is None else ids_from_lengths(*docs).to(DEV),
        None if blocks is None else torch.tensor(blocks, device=DEV),
    )


def _tiles(BQ, BK, E, S):
    return index_scores_mod._option_values(index_scores_mod.tile_options(BQ, BK, E, S))


@pytest.mark.parametrize("with_grad", [True, False], ids=["grad-winners", "no-grad"])
@pytest.mark.parametrize("B,H,N,E,S,BQ,BK,seq_lens,docs,blocks", OP_CASES)
def test_index_block_scores_op_passes_opcheck(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks, with_grad):
    """The forward op's schema, fake (shapes, dtypes, strides), autograd registration and AOT dispatch; with
    autograd the winners are stored and the gradient goes through the backward op."""
    u, w, lens, ids, listed = _op_inputs(B, H, N, E, S, BQ, seq_lens, docs, blocks)
    args = (u.requires_grad_(with_grad), w.requires_grad_(with_grad), lens, ids, listed, BQ, BK, _tiles(BQ, BK, E, S))
    torch.library.opcheck(torch.ops.sparse_train.index_block_scores.default, (*args, with_grad))


@pytest.mark.parametrize("need_u,need_w", [(True, True), (True, False), (False, True)], ids=["du-dw", "du", "dw"])
def test_index_block_scores_backward_op_passes_opcheck(need_u, need_w):
    B, H, N, E, S, BQ, BK = 2, 2, 37, 2, 16, 16, 16
    u, w, lens, ids, listed = _op_inputs(B, H, N, E, S, BQ, (37, 20), None, None)
    args = check_index_score_args(u, w, BQ, BK, lens)
    scores, win_row, win_key = index_block_scores_launch(u, w, args, seq_lens=lens, with_winner=True)
    grad = torch.randn(scores.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
    torch.library.opcheck(
        torch.ops.sparse_train.index_block_scores_bwd.default, (grad, scores, win_row, win_key, u, w, need_u, need_w)
    )


@pytest.mark.parametrize("B,H,N,E,S,BQ,BK,seq_lens,docs,blocks", OP_CASES)
def test_index_block_scores_op_compiled_fullgraph_equals_eager(B, H, N, E, S, BQ, BK, seq_lens, docs, blocks):
    """A fullgraph-compiled function of the op (forward, and the backward AOT autograd derives from its
    registration) gives the eager public function's scores bit for bit and its gradients of u and w."""
    u, w, lens, ids, listed = _op_inputs(B, H, N, E, S, BQ, seq_lens, docs, blocks)
    tiles = _tiles(BQ, BK, E, S)
    grad = None

    def weighted(scores):
        return (torch.where(torch.isfinite(scores), scores, 0.0) * grad).sum()

    def compiled_call(u, w):
        scores, _, _ = torch.ops.sparse_train.index_block_scores(u, w, lens, ids, listed, BQ, BK, tiles, True)
        return scores, weighted(scores)

    eager_u, eager_w = u.clone().requires_grad_(), w.clone().requires_grad_()
    want = index_block_scores(
        eager_u, eager_w, block_q=BQ, block_k=BK, seq_lens=lens, document_ids=ids, query_blocks=listed, backend=BACKEND
    )
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    weighted(want).backward()
    u.requires_grad_()
    w.requires_grad_()
    got, total = compiled_fullgraph(compiled_call)(u, w)
    total.backward()
    assert torch.equal(got, want)
    torch.testing.assert_close(u.grad, eager_u.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, eager_w.grad, rtol=1e-6, atol=1e-6)


def test_index_block_scores_public_function_compiled_fullgraph_equals_eager():
    """The public function (checks, tile options, dispatch) compiled with fullgraph, forward and backward: the eager
    scores and gradients. (Without seq_lens, documents and listed blocks: their values are checked on the CPU, a
    host read.)"""
    u, w = _inputs(1, 2, 37, 2, 16, seed=8)

    def total(u, w):
        scores = index_block_scores(u, w, block_q=16, block_k=16, backend=BACKEND)
        return scores, torch.where(torch.isfinite(scores), scores, 0.0).sum()

    results = []
    for call in (total, compiled_fullgraph(total)):
        leaves = [t.clone().requires_grad_() for t in (u, w)]
        scores, loss = call(*leaves)
        loss.backward()
        results.append((scores, *(leaf.grad for leaf in leaves)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_index_block_scores_takes_the_op_under_a_dispatch_mode():
    """Under a TorchDispatchMode (selective checkpointing, fake tensors) the public function calls the custom ops
    (forward and backward), with the results of its direct launch."""
    u, w, lens, ids, listed = _op_inputs(2, 1, 45, 1, 20, 16, (45, 30), ((20, 25), (10, 35)), (2, 0))
    kwargs = dict(block_q=16, block_k=32, seq_lens=lens, document_ids=ids, query_blocks=listed, backend=BACKEND)
    u.requires_grad_()
    w.requires_grad_()
    direct = index_block_scores(u, w, **kwargs)
    grad = torch.randn(direct.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    want = torch.autograd.grad(direct, (u, w), grad)
    with OpRecorder() as recorder:
        via_op = index_block_scores(u, w, **kwargs)
        got = torch.autograd.grad(via_op, (u, w), grad)
    assert "sparse_train::index_block_scores" in recorder.ops
    assert "sparse_train::index_block_scores_bwd" in recorder.ops
    assert torch.equal(via_op, direct)
    for g, e in zip(got, want):
        assert torch.equal(g, e)


# ---------------------------------------------------------------------------------------------- GPU
def _winner_gradients64(grad, scores, win_row, win_key, u, w):
    """du, dw in float64 by a plain scatter at the kernel's winners (the reference of the backward's scatter)."""
    B, H, M, E, S = u.shape
    N = w.shape[2]
    found = torch.isfinite(scores)
    b, h, _, _ = found.nonzero(as_tuple=True)
    row, key = win_row[found].long(), win_key[found].long()
    g = grad[found].double().unsqueeze(-1)
    du = torch.zeros(B, H, M * E, S, dtype=torch.float64, device=u.device)
    dw = torch.zeros(B, H, N, S, dtype=torch.float64, device=u.device)
    du.index_put_((b, h, row), g * w.double()[b, h, key], accumulate=True)
    dw.index_put_((b, h, key), g * u.double().reshape(B, H, M * E, S)[b, h, row], accumulate=True)
    return du.view(B, H, M, E, S), dw


def _check_gpu(u, w, grad_seed, **kwargs):
    """Scores against the fp64 reference (error-ratio rule vs the reference on the same low-precision inputs,
    summed in fp32), winners valid maxima, gradients against an fp64 scatter at the kernel's winners (at these
    sizes an fp32 near-tie may pick a different winner than fp64, so the gradients are not compared with the
    reference's amax)."""
    dtype = u.dtype
    u.requires_grad_()
    w.requires_grad_()
    got = index_block_scores(u, w, **kwargs)
    grad = torch.randn(got.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(grad_seed))
    du, dw = torch.autograd.grad(got, (u, w), grad)
    with torch.no_grad():
        ref = reference_index_block_scores(u.double(), w.double(), **kwargs)
        low = reference_index_block_scores(u, w, **kwargs)
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref))
        check_close(f"scores {dtype}", got, ref, low, torch.float32)
        args = check_index_score_args(
            u,
            w,
            kwargs["block_q"],
            kwargs["block_k"],
            kwargs.get("seq_lens"),
            kwargs.get("document_ids"),
            kwargs.get("query_blocks"),
        )
        scores, win_row, win_key = index_block_scores_launch(
            u,
            w,
            args,
            seq_lens=kwargs.get("seq_lens"),
            document_ids=kwargs.get("document_ids"),
            query_blocks=kwargs.get("query_blocks"),
            with_winner=True,
        )
        assert torch.equal(scores, got)
        finite = torch.isfinite(ref)
        E = u.shape[3]
        b, h, _, _ = finite.nonzero(as_tuple=True)
        row, key = win_row[finite].long(), win_key[finite].long()
        logit = (u.double()[b, h, row // E, row % E] * w.double()[b, h, key]).sum(-1)
        gap = (ref[finite] - logit).abs().max().item()
        print(f"winner logit vs fp64 max: largest gap {gap:.2e}")
        assert gap <= 1e-5 * ref[finite].abs().max().item(), "a winner is not the block's max up to fp32 rounding"
        ref_du, ref_dw = _winner_gradients64(grad, got, win_row, win_key, torch.nan_to_num(u), torch.nan_to_num(w))
        assert rel_err(_finite(du), ref_du) < 1e-2 and rel_err(_finite(dw), ref_dw) < 1e-2  # rounding to bf16/fp16


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 3, 4, 8])
@pytest.mark.parametrize("seq_len", [4097, 16384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_index_scores_gpu_real_sizes(dtype, seq_len, heads):
    """B = 2: row 0 packs three documents (boundaries inside blocks), row 1 is cut by seq_lens with NaN padding."""
    B, E, S = 2, 2, 32
    lens = (seq_len, seq_len - 1001)
    u, w = _inputs(B, heads, seq_len, E, S, seed=seq_len + heads, dtype=dtype, device="cuda", seq_lens=lens)
    first = seq_len // 3 + 17
    docs = ids_from_lengths((first, seq_len // 2, seq_len - first - seq_len // 2), (seq_len,)).cuda()
    _check_gpu(u, w, heads, block_q=64, block_k=64, seq_lens=torch.tensor(lens, device="cuda"), document_ids=docs)


@pytest.mark.gpu
def test_index_scores_gpu_128k_on_listed_query_blocks():
    """128K (B = 1, H = 2): the kernel on a few listed query blocks (the first, the last, inside) against the
    reference, and the rows of the full kernel at those blocks equal the listed ones bit for bit."""
    N, H, E, S, P = 131072, 2, 2, 32, 64
    u, w = _inputs(1, H, N, E, S, seed=128, dtype=torch.bfloat16, device="cuda")
    blocks = torch.tensor([2047, 0, 1000, 1500, 2046], device="cuda")
    rows = (blocks.view(-1, 1) * P + torch.arange(P, device="cuda")).reshape(-1)
    u_blocks = u[:, :, rows].contiguous()
    _check_gpu(u_blocks, w, 0, block_q=P, block_k=P, query_blocks=blocks)
    with torch.no_grad():
        full = index_block_scores(u, w, block_q=P, block_k=P)
        listed = index_block_scores(u_blocks, w, block_q=P, block_k=P, query_blocks=blocks)
    assert torch.equal(full[:, :, blocks], listed)


@pytest.mark.gpu
def test_index_scores_gpu_never_synchronises_and_captures():
    """Forward and backward make no device -> host synchronisation (``set_sync_debug_mode("error")`` raises on
    one), with seq_lens, documents and listed query blocks; the no-grad forward captures in a CUDA graph whose
    replay gives the eager scores."""
    from sparse_train.cuda_graphs import capture_cuda_graph

    N, H, E, S, P = 4097, 4, 2, 32, 64
    u, w = _inputs(
        2, H, N, E, S, blocks=(64, 3, 30), block_q=P, seed=2, dtype=torch.bfloat16, device="cuda", seq_lens=(N, 3000)
    )
    kwargs = {
        "block_q": P,
        "block_k": P,
        "seq_lens": torch.tensor([N, 3000], device="cuda"),
        "document_ids": ids_from_lengths((1000, N - 1000), (N,)).cuda(),
        "query_blocks": torch.tensor([64, 3, 30], device="cuda"),
    }
    u.requires_grad_()
    w.requires_grad_()

    def step():
        scores = index_block_scores(u, w, **kwargs)
        return torch.autograd.grad(scores, (u, w), torch.ones_like(scores))

    step()  # warm-up: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        du, dw = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(du).all() and torch.isfinite(dw).all()

    def forward():
        with torch.no_grad():
            return index_block_scores(u, w, **kwargs)

    eager = forward()
    graph, captured = capture_cuda_graph(forward)
    captured.fill_(0.0)
    graph.replay()
    assert torch.equal(captured, eager)


# ---------------------------------------------------------------------------------------------- compile for Hopper
def hopper_compile_report(cases):
    """[(registers, spill store bytes, shared bytes)] of the kernel compiled for sm_90a at the automatic tiles of
    each ``(E, S, with_winner_docs_lengths, blocks_per_program, keys_major)`` case (block 64, bf16). Runs in a
    process without the interpreter (the test below starts one, :func:`builders.compile_report_in_subprocess`)."""
    import triton

    from sparse_train.kernels.triton.index_scores import (
        _index_block_scores_kernel,
        tile_options,
    )

    report = []
    for E, S, full, per_program, keys_major in cases:
        block, N = 64, 256
        tiles = tile_options(
            block, block, E, S, IndexScoreOptions(blocks_per_program=per_program, keys_major=keys_major)
        )
        rows = triton.next_power_of_2(block * E)
        u = torch.zeros(1, 2, N, E, S, dtype=torch.bfloat16)
        w = torch.zeros(1, 2, N, S, dtype=torch.bfloat16)
        out, ints = torch.zeros(1, 2, 4, 4), torch.zeros(4, dtype=torch.int32)
        compiled = warmup_for_hopper(
            _index_block_scores_kernel,
            u,
            w,
            ints,
            ints,
            ints,
            out,
            ints,
            ints,
            *u.stride(),
            *w.stride(),
            2,
            N,
            4,
            4,
            S,
            9,
            E=E,
            BLOCK_Q=block,
            BLOCK_K=block,
            S_P2=max(16, triton.next_power_of_2(S)),
            ROW_TILE=tiles.row_tile,
            ROW_SLICES=rows // tiles.row_tile,
            KEY_BLOCKS=max(1, tiles.key_tile // block),
            PAIR=per_program == 2,
            FILL=256,
            HAS_QUERY_BLOCKS=full,
            HAS_SEQ_LENS=full,
            HAS_DOCS=full,
            WITH_WINNER=full,
            IEEE=False,
            KEYS_MAJOR=tiles.keys_major,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            grid=(1, 1),
        )
        report.append((*ptxas_usage(compiled), compiled.metadata.shared))
    return report


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
def test_index_scores_kernel_compiles_for_hopper_without_spills():
    """The interpreter accepts programs the compiler rejects: the kernel compiles for sm_90a (ptxas ships with
    triton) at the automatic tiles of the benchmark's (E, S), with winners, documents, lengths and listed query
    blocks (the most registers) and without, one or two query blocks per program, and no register spills."""
    if ptxas_path() is None:
        pytest.skip("this triton ships no ptxas")
    cases = [
        (E, S, full, per_program, keys_major)
        for E, S, full, per_program in [
            (1, 32, False, 1),
            (1, 32, True, 1),
            (1, 64, True, 1),
            (2, 32, True, 1),
            (4, 16, True, 1),
            (4, 32, True, 1),
            (1, 32, False, 2),
            (1, 32, True, 2),
            (2, 32, True, 2),
        ]
        for keys_major in (False, True)
    ]
    report = compile_report_in_subprocess(__file__, "hopper_compile_report", cases)
    for (E, S, full, pair, keys_major), (registers, spills, shared) in zip(cases, report):
        print(
            f"E={E} S={S} full={full} blocks per program {pair} keys major {keys_major}: {registers} registers, "
            f"{spills} bytes spilled, {shared} bytes shared"
        )
        assert spills == 0
