"""Context parallelism (sparse_train.parallel.context_parallel): the zig-zag layout helpers, and the attention and the
selector on two CPU processes (gloo; the reference backend in float64, the Triton kernels through the
interpreter in float32) against the single-process computation on the same global tensors: outputs, lse,
dq, dk, dv, scores and the global index.

One spawn runs every two-process case (a spawn costs seconds of imports on the CI's two cores); the workers
write their local results and the tests compare them here. The spawn helper is local rather than imported
from test_fsdp.py, whose imports (Lightning) would cost each worker ~3 s more.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from builders import check_close, ids_from_starts, make_qkv, random_index, rel_err, spawn_ranks, value_errors_of

import sparse_train.parallel.context_parallel as cp
from sparse_train.documents import document_positions
from sparse_train.index.block_index import BlockIndex
from sparse_train.kernels.reference.attention import reference_sparse_attention
from sparse_train.selection.indexer import OracleSelector, TokenIndexer
from sparse_train.selection.scorer import (
    EMPTY_BLOCK_SCORE,
    BlockScorer,
    rope_inverse_frequencies,
    selection_candidates,
    selection_geometry,
)

WORLD = 2
FP64_REL = 1e-12  # float64: the sharded computation differs from the one-process one only in summation order

# (id, B, HQ, HKV, N, D, BQ, BK, extras): N is a multiple of 2 * W * lcm(BQ, BK); D odd on purpose.
ATTENTION_CASES = [
    ("gqa", 1, 4, 2, 64, 5, 8, 8, {}),
    ("seq_lens_nan_padding", 2, 4, 2, 64, 5, 8, 8, {"seq_lens": [64, 37], "nan_padding": True}),
    ("documents", 2, 4, 2, 64, 5, 8, 8, {"documents": [[0, 5, 21, 40], [0, 33]]}),
    ("dropout", 2, 4, 2, 64, 5, 8, 8, {"dropout_p": 0.3, "seq_lens": [64, 50]}),
    ("bq16_bk4_scale", 1, 2, 1, 64, 5, 16, 4, {"seq_lens": [61], "scale": 0.3}),
    # the Triton kernels (interpreter, float32; D and the blocks in the kernels' sizes), r0 = 2: hot and cold
    # key blocks, so the KV-centric and the atomic dK/dV paths both run on the local plan
    (
        "triton_gqa_seq_lens_hybrid",
        2,
        4,
        2,
        64,
        16,
        16,
        16,
        {"seq_lens": [64, 37], "backend": "triton", "kernel_options": {"r0": 2}},
    ),
    (
        "triton_documents_dropout",
        2,
        2,
        1,
        64,
        16,
        16,
        16,
        {"documents": [[0, 5, 21, 40], [0, 33]], "dropout_p": 0.3, "backend": "triton"},
    ),
]
SELECTOR_CASES = [
    ("rope_bias_seq_lens", {"seq_lens": [64, 45]}),
    ("documents", {"documents": [[0, 5, 21, 40], [0, 33]]}),
]
SEL = dict(B=2, HQ=4, HKV=2, N=64, D=8, BQ=8, BK=8, top_k=2, window=1, sinks=1)
# The token selector (TokenIndexer): float64 inputs (its reference path computes in float64), D odd with RoPE on the
# first 4 channels, two index heads, blocks of its kernels' sizes. (id, BQ, extras).
TOKEN = dict(B=2, HQ=4, HKV=2, N=128, D=5, BK=16, top_k=2, window=1, sinks=1)
TOKEN_SELECTOR_CASES = [
    ("token_rope_bias_seq_lens_nan_padding", 16, {"seq_lens": [128, 75]}),
    ("token_documents", 16, {"documents": [[0, 5, 40, 90], [0, 70]]}),
    ("token_candidates_bq32_bk16", 32, {"candidates": 2, "seq_lens": [128, 100]}),
]


def _attention_inputs(case):
    """Global q, k, v, dO, index, seq_lens, document_ids, dropout_p, scale of a case (the same in the workers
    and here)."""
    _, B, HQ, HKV, N, D, BQ, BK, extras = case
    dtype = torch.float32 if extras.get("backend") == "triton" else torch.float64
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype=dtype, seed=N + D)
    grad_out = torch.randn(B, HQ, N, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    docs = ids_from_starts(extras["documents"], N) if "documents" in extras else None
    seq_lens = torch.tensor(extras["seq_lens"]) if "seq_lens" in extras else None
    if extras.get("nan_padding"):  # keys past a length are selected away: NaN there reaches nothing
        past = torch.arange(N).view(1, 1, N, 1) >= seq_lens.view(-1, 1, 1, 1)
        k, v = (torch.where(past, float("nan"), t) for t in (k, v))
    if docs is None:
        index = random_index(B, HKV, N, BQ, BK, 2, 1, 1, seed=3)
    else:
        from builders import random_selection

        index = BlockIndex.from_selection(
            random_selection(B, HKV, N, BQ, BK, 2, seed=3),
            seq_len=N,
            block_q=BQ,
            block_k=BK,
            window=1,
            sinks=1,
            document_ids=docs,
        )
    return q, k, v, grad_out, index, seq_lens, docs, extras.get("dropout_p", 0.0), extras.get("scale")


def _scorer():
    """A scorer with RoPE un-rotation, the mean_max key pooling and a non-zero distance bias (every term)."""
    torch.manual_seed(11)
    scorer = BlockScorer(SEL["HQ"], SEL["HKV"], SEL["D"], selector_dim=4, key_pooling="mean_max", distance_bias=True)
    with torch.no_grad():
        for p in scorer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    scorer.set_rope(rope_inverse_frequencies(100.0, SEL["D"]))
    return scorer


def _selector_inputs(case):
    _, extras = case
    q, k, _ = make_qkv(SEL["B"], SEL["HQ"], SEL["HKV"], SEL["N"], SEL["D"], dtype=torch.float32, seed=21)
    seq_lens = torch.tensor(extras["seq_lens"]) if "seq_lens" in extras else None
    docs = ids_from_starts(extras["documents"], SEL["N"]) if "documents" in extras else None
    geometry = selection_geometry(SEL["N"], SEL["BQ"], SEL["BK"], SEL["top_k"], SEL["window"], SEL["sinks"])
    return q, k, seq_lens, docs, geometry


def _token_indexer(extras):
    """A token indexer with RoPE un-rotation over 4 of the 5 channels, two index heads, a non-zero distance bias and
    perturbed projections (every term), float64."""
    torch.manual_seed(13)
    indexer = TokenIndexer(
        TOKEN["HQ"],
        TOKEN["HKV"],
        TOKEN["D"],
        index_dim=3,
        index_heads=2,
        distance_bias=True,
        candidates=extras.get("candidates"),
        window=TOKEN["window"],
        sinks=TOKEN["sinks"],
    ).double()
    with torch.no_grad():
        for p in indexer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    indexer.set_rope(rope_inverse_frequencies(100.0, 4))
    return indexer


def _token_inputs(case):
    """Global q, k (float64, NaN past seq_lens: the un-rotation must zero those rows), seq_lens, document ids and
    the geometry of a token case."""
    _, block_q, extras = case
    q, k, _ = make_qkv(TOKEN["B"], TOKEN["HQ"], TOKEN["HKV"], TOKEN["N"], TOKEN["D"], dtype=torch.float64, seed=23)
    seq_lens = torch.tensor(extras["seq_lens"]) if "seq_lens" in extras else None
    if seq_lens is not None:
        past = torch.arange(TOKEN["N"]).view(1, 1, -1, 1) >= seq_lens.view(-1, 1, 1, 1)
        q, k = (torch.where(past, float("nan"), t) for t in (q, k))
    docs = ids_from_starts(extras["documents"], TOKEN["N"]) if "documents" in extras else None
    geometry = selection_geometry(TOKEN["N"], block_q, TOKEN["BK"], TOKEN["top_k"], TOKEN["window"], TOKEN["sinks"])
    return q, k, seq_lens, docs, geometry


# --------------------------------------------------------------------------------------------- the workers
def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {"attention": {}, "selector": {}}

    for case in ATTENTION_CASES:
        q, k, v, grad_out, index, seq_lens, docs, p, scale = _attention_inputs(case)
        seed = cp.shared_dropout_seed() if p > 0 else None
        local = [cp.shard_sequence(t, 2, rank, WORLD).detach().requires_grad_() for t in (q, k, v)]
        o, lse = cp.context_parallel_sparse_attention(
            *local,
            index,
            scale=scale,
            dropout_p=p,
            dropout_seed=seed,
            seq_lens=seq_lens,
            document_ids=docs,
            return_lse=True,
            backend=case[-1].get("backend", "reference"),
            kernel_options=case[-1].get("kernel_options"),
        )
        (o * cp.shard_sequence(grad_out, 2, rank, WORLD)).sum().backward()
        results["attention"][case[0]] = dict(
            o=o.detach(), lse=lse.detach(), dq=local[0].grad, dk=local[1].grad, dv=local[2].grad, seed=seed
        )

    for case in SELECTOR_CASES:
        q, k, seq_lens, docs, geometry = _selector_inputs(case)
        scorer = _scorer()
        q_local, k_local = (cp.shard_sequence(t, 2, rank, WORLD) for t in (q, k))
        scores = cp.context_parallel_block_scores(
            scorer,
            q_local,
            k_local,
            block_q=SEL["BQ"],
            block_k=SEL["BK"],
            scale=SEL["D"] ** -0.5,
            seq_lens=seq_lens,
            document_ids=docs,
            geometry=geometry,
        )
        index = cp.context_parallel_selection(
            scores, geometry, window=SEL["window"], sinks=SEL["sinks"], seq_lens=seq_lens, document_ids=docs
        )
        scores.sum().backward()  # the distillation's path: local scores -> the scorer's parameters
        results["selector"][case[0]] = dict(
            scores=scores.detach(),
            indices=index.indices,
            counts=index.counts,
            grads={n: p.grad for n, p in scorer.named_parameters()},
        )

    results["token_selector"] = {}
    for case in TOKEN_SELECTOR_CASES:
        q, k, seq_lens, docs, geometry = _token_inputs(case)
        indexer = _token_indexer(case[-1])
        q_local, k_local = (cp.shard_sequence(t, 2, rank, WORLD) for t in (q, k))
        scores = cp.context_parallel_block_scores(
            indexer,
            q_local,
            k_local,
            block_q=case[1],
            block_k=TOKEN["BK"],
            scale=0.4,
            seq_lens=seq_lens,
            document_ids=docs,
            geometry=geometry,
        )
        index = cp.context_parallel_selection(
            scores, geometry, window=TOKEN["window"], sinks=TOKEN["sinks"], seq_lens=seq_lens, document_ids=docs
        )
        scores.sum().backward()
        results["token_selector"][case[0]] = dict(
            scores=scores.detach(),
            indices=index.indices,
            counts=index.counts,
            grads={n: p.grad for n, p in indexer.named_parameters()},
        )

    x = torch.arange(2 * 3 * 16, dtype=torch.float64).view(2, 3, 16)
    results["round_trip"] = cp.gather_sequence(cp.shard_sequence(x, -1, rank, WORLD), -1)

    q, k, v, _, index, _, _, _, _ = _attention_inputs(ATTENTION_CASES[0])
    ql, kl, vl = (cp.shard_sequence(t, 2, rank, WORLD) for t in (q, k, v))
    half = random_index(1, 2, 32, 8, 8, 2, 1, 1)
    results["errors"] = value_errors_of(
        [
            lambda: cp.context_parallel_sparse_attention(ql[:, :, :16], kl[:, :, :16], vl[:, :, :16], index),
            lambda: cp.context_parallel_sparse_attention(ql, kl, vl, half),
            lambda: cp.context_parallel_sparse_attention(ql, kl, vl, random_index(2, 2, 64, 8, 8, 2, 1, 1)),
            lambda: cp.context_parallel_sparse_attention(ql, kl.float(), vl, index),
            lambda: cp.context_parallel_sparse_attention(ql, kl, vl, index, dropout_p=0.1),
            lambda: cp.context_parallel_sparse_attention(ql, kl, vl, index, seq_lens=torch.tensor([40, 40])),
            lambda: cp.context_parallel_sparse_attention(
                ql, kl, vl, index, document_ids=torch.zeros(1, 32, dtype=torch.int64)
            ),
            lambda: cp.context_parallel_sparse_attention(ql, kl, vl, random_index(1, 2, 64, 32, 32, 2, 1, 1)),
            lambda: cp.context_parallel_sparse_attention(ql, kl, vl, index, scale=float("nan")),
            lambda: cp.context_parallel_sparse_attention(ql.float(), kl.float(), vl.float(), index, backend="triton"),
            lambda: cp.context_parallel_sparse_attention(ql, kl, vl, index, kernel_options={"plan": index.plan()}),
            lambda: cp.context_parallel_block_scores(OracleSelector(4, 2, 5), ql, kl, block_q=8, block_k=8, scale=1.0),
            lambda: cp.context_parallel_block_scores(_token_indexer({}), ql, kl, block_q=16, block_k=16, scale=1.0),
        ]
    )
    dist.barrier()  # every rank got past the bad calls without a collective left hanging
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every two-process case, run once: the per-rank result dicts."""
    out = tmp_path_factory.mktemp("context_parallel")
    spawn_ranks(_worker, WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# --------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_two_ranks_equal_the_single_process_attention(two_ranks, case):
    """Each rank's o, lse, dq, dk, dv equal its rows of the single-process reference on the global tensors
    (float64, relative error <= 1e-12): GQA, a random selection with window and sinks, global seq_lens (a
    row shorter than N, whole key blocks masked on one rank, NaN in k and v past the length), packed
    documents with boundaries inside blocks, dropout with a seed broadcast from rank 0 (the keep bits are
    drawn at global positions: one flipped bit would move o by O(1)), and BQ != BK with an explicit scale.
    dK/dV are the reduce-scatter of the all-gather's backward: both ranks' contributions summed.
    The Triton cases (float32 through the interpreter) meet the repo's error-ratio rule against the float64
    single-process reference, as the single-process kernels do."""
    q, k, v, grad_out, index, seq_lens, docs, p, scale = _attention_inputs(case)
    seeds = {r["attention"][case[0]]["seed"] for r in two_ranks}
    assert len(seeds) == 1  # the broadcast seed is the same on both ranks
    seed = seeds.pop()
    assert (seed is not None) == (p > 0)
    triton = case[-1].get("backend") == "triton"

    def single_process(dtype, **kwargs):
        qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        o, lse = reference_sparse_attention(
            qs,
            ks,
            vs,
            index,
            scale=scale,
            dropout_p=p,
            dropout_seed=seed,
            seq_lens=seq_lens,
            document_ids=docs,
            **kwargs,
        )
        (o * grad_out.to(dtype)).sum().backward()
        return dict(o=o.detach(), lse=lse.detach(), dq=qs.grad, dk=ks.grad, dv=vs.grad)

    want = single_process(torch.float64)
    lowp = single_process(torch.float32, upcast=False) if triton else None
    for rank, result in enumerate(two_ranks):
        got = result["attention"][case[0]]
        for name, full in want.items():
            local = cp.shard_sequence(full, 2, rank, WORLD)
            assert got[name].shape == local.shape, (rank, name)
            if triton:
                check_close(
                    f"rank {rank} {name}",
                    got[name],
                    local,
                    cp.shard_sequence(lowp[name], 2, rank, WORLD),
                    torch.float32,
                )
            else:
                error = rel_err(got[name], local)
                assert error <= FP64_REL, f"rank {rank} {name}: relative error {error:.2e}"
    if p > 0:  # the test has teeth: without dropout the output differs
        o_plain, _ = reference_sparse_attention(
            q.double(), k.double(), v.double(), index, seq_lens=seq_lens, document_ids=docs
        )
        assert rel_err(o_plain, want["o"]) > 1e-2


def test_gather_sequence_inverts_shard_sequence(two_ranks):
    x = torch.arange(2 * 3 * 16, dtype=torch.float64).view(2, 3, 16)
    for result in two_ranks:
        assert torch.equal(result["round_trip"], x)


def test_bad_arguments_raise_before_any_collective(two_ranks):
    """Wrong local length, an index for another N, batch mismatch, mixed dtypes, dropout without a seed,
    seq_lens / document_ids of the wrong batch or length, N not a multiple of 2 * W * block, a bad scale,
    backend="triton" on a head dim the kernels lack, a whole-index plan, the block scores of the oracle selector or of
    the token selector without the geometry: each raises a ValueError naming the
    problem on the rank that sees it, and no collective is left waiting (the workers reach the barrier
    after them)."""
    expected = [
        "local rows",
        "local rows",
        "batch",
        "share a dtype",
        "dropout_seed",
        "seq_lens has 2 entries",
        "document_ids must have shape",
        "multiple of 2 * W",
        "scale",
        "head dim 5",
        "kernel_options.plan cannot be combined with query_blocks",
        "does not support the oracle selector",
        "needs geometry",
    ]
    for result in two_ranks:
        assert len(result["errors"]) == len(expected)
        for message, want in zip(result["errors"], expected):
            assert want in message, (want, message)


# --------------------------------------------------------------------------------------------- selector
@pytest.mark.parametrize("case", SELECTOR_CASES, ids=[c[0] for c in SELECTOR_CASES])
def test_two_ranks_select_the_single_process_index(two_ranks, case):
    """The selector under CP: pooled keys all-gathered, local query blocks scored (RoPE un-rotated at
    global positions, mean_max pooling, distance bias of the local rows), local candidates all-gathered:
    the scores equal the single-process rows, every rank builds the single-process index exactly, and the
    scorer's parameter gradients summed over the ranks equal the single-process ones (the sum a
    data-parallel all-reduce forms)."""
    q, k, seq_lens, docs, geometry = _selector_inputs(case)
    scorer = _scorer()
    positions = None
    if docs is not None:
        from sparse_train.documents import document_positions

        positions = document_positions(docs)
    qbar, kbar = scorer.pool(q, k, SEL["BQ"], SEL["BK"], seq_lens, positions)
    scores = scorer(qbar, kbar, SEL["D"] ** -0.5, geometry)
    scores.sum().backward()
    candidates = selection_candidates(
        scores, geometry, window=SEL["window"], sinks=SEL["sinks"], seq_lens=seq_lens, document_ids=docs
    )
    capacity = geometry.capacity if docs is None else geometry.document_capacity
    index = BlockIndex.from_selection(
        candidates,
        seq_len=SEL["N"],
        block_q=SEL["BQ"],
        block_k=SEL["BK"],
        window=SEL["window"],
        sinks=SEL["sinks"],
        capacity=capacity,
        document_ids=docs,
    )
    for rank, result in enumerate(two_ranks):
        got = result["selector"][case[0]]
        rows = cp.local_query_blocks(SEL["N"], SEL["BQ"], rank, WORLD)
        # float32 scores: the local matmul covers fewer rows than the global one (other blocking)
        torch.testing.assert_close(got["scores"], scores.detach()[:, :, rows], rtol=1e-5, atol=1e-5)
        assert torch.equal(got["indices"], index.indices), rank
        assert torch.equal(got["counts"], index.counts), rank
    for name, param in scorer.named_parameters():
        grads = [result["selector"][case[0]]["grads"][name] for result in two_ranks]
        assert all(g is not None for g in grads), name
        summed = sum(grads)
        torch.testing.assert_close(summed, param.grad, rtol=1e-5, atol=1e-5)


def _score_error(got, want) -> float:
    """Relative error of the scored block pairs; the pairs without a valid (row, key) must be the same and score
    ``EMPTY_BLOCK_SCORE`` (-1e30, which would swamp a relative error over all entries)."""
    empty = want == EMPTY_BLOCK_SCORE
    assert torch.equal(got == EMPTY_BLOCK_SCORE, empty), "the empty block pairs differ"
    assert (~empty).sum() >= want[..., 0].numel()  # as many scored pairs as (batch, head, query block) rows
    return rel_err(got[~empty], want[~empty])


def _token_single_process(indexer, q, k, seq_lens, docs, geometry):
    """The single-process token selection: scores (with the parameters' gradients of their sum) and the index."""
    positions = document_positions(docs) if docs is not None else None
    queries, keys = indexer.pool(q, k, geometry.block_q, TOKEN["BK"], seq_lens, positions)
    scores = indexer(queries, keys, 0.4, geometry, seq_lens=seq_lens, document_ids=docs)
    scores.sum().backward()
    candidates = selection_candidates(
        scores, geometry, window=TOKEN["window"], sinks=TOKEN["sinks"], seq_lens=seq_lens, document_ids=docs
    )
    index = BlockIndex.from_selection(
        candidates,
        seq_len=TOKEN["N"],
        block_q=geometry.block_q,
        block_k=TOKEN["BK"],
        window=TOKEN["window"],
        sinks=TOKEN["sinks"],
        capacity=geometry.capacity if docs is None else geometry.document_capacity,
        document_ids=docs,
    )
    return scores.detach(), index


@pytest.mark.parametrize("case", TOKEN_SELECTOR_CASES, ids=[c[0] for c in TOKEN_SELECTOR_CASES])
def test_two_ranks_select_the_single_process_index_with_the_token_selector(two_ranks, case):
    """The token selector under CP (``context_parallel_block_scores`` with a TokenIndexer): q and k un-rotated at
    the GLOBAL positions of the local rows (per document with packed documents), the un-rotated keys all-gathered,
    the local rows' index queries scored against every index key (two index heads, distance bias of the local rows;
    exact scores, or the candidates' with BQ != BK): each rank's scores are its rows of the single-process scores
    (float64 inputs; relative error <= 1e-12), every rank builds the single-process index exactly, and the
    indexer's parameter gradients summed over the ranks equal the single-process ones (at float32 precision, the
    indexer's). NaN in q and k past the lengths reaches nothing."""
    q, k, seq_lens, docs, geometry = _token_inputs(case)
    indexer = _token_indexer(case[-1])
    scores, index = _token_single_process(indexer, q, k, seq_lens, docs, geometry)
    assert torch.isfinite(scores).all()
    for rank, result in enumerate(two_ranks):
        got = result["token_selector"][case[0]]
        rows = cp.local_query_blocks(TOKEN["N"], geometry.block_q, rank, WORLD)
        error = _score_error(got["scores"], scores[:, :, rows])
        assert error <= FP64_REL, f"rank {rank} scores: relative error {error:.2e}"
        assert torch.equal(got["indices"], index.indices), rank
        assert torch.equal(got["counts"], index.counts), rank
    for name, param in indexer.named_parameters():
        grads = [result["token_selector"][case[0]]["grads"][name] for result in two_ranks]
        assert all(g is not None for g in grads), name
        # the indexer's weights, temperature and scores are float32 whatever the input dtype: the ranks' partial
        # gradients add in another order than one process sums them (measured: at most 4e-8)
        error = rel_err(sum(grads), param.grad)
        assert error <= 1e-6, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("where", ["global", "local"])
def test_token_selector_shards_need_global_positions(where):
    """One process playing both ranks (the all-gather replaced by placing each rank's un-rotated keys at their
    global rows): the shards' scores equal the single-process rows exactly when the local rows are un-rotated at
    their GLOBAL positions, and differ when they are un-rotated at local ones (0 .. N/W - 1), so the two-rank test
    above would catch that mistake."""
    case = TOKEN_SELECTOR_CASES[0]
    q, k, seq_lens, _, geometry = _token_inputs(case)
    indexer = _token_indexer(case[-1])
    full, _ = _token_single_process(indexer, q, k, seq_lens, None, geometry)
    n, bq = TOKEN["N"], geometry.block_q
    shards = []
    for rank in range(WORLD):
        rows = cp.local_query_blocks(n, bq, rank, WORLD)
        positions = cp.zigzag_positions(n, rank, WORLD) if where == "global" else torch.arange(n // WORLD)
        valid = cp._local_valid_lengths(seq_lens, n, rank, WORLD)
        local_q, local_k = (cp.shard_sequence(t, 2, rank, WORLD) for t in (q, k))
        shards.append(
            (rows, cp.zigzag_positions(n, rank, WORLD), *indexer.pool(local_q, local_k, bq, 16, valid, positions, rows))
        )
    keys = torch.zeros(TOKEN["B"], TOKEN["HKV"], n, TOKEN["D"], dtype=torch.float64)
    for _, rows_at, _, local_keys in shards:
        keys.index_copy_(2, rows_at, local_keys)
    with torch.no_grad():
        errors = [
            _score_error(indexer(queries, keys, 0.4, geometry, rows, seq_lens=seq_lens), full[:, :, rows])
            for rows, _, queries, _ in shards
        ]
    if where == "global":
        assert max(errors) <= FP64_REL, errors
    else:
        assert min(errors) > 1e-3, errors


# --------------------------------------------------------------------------------------------- layout, one process
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_layout_covers_the_sequence_once_with_equal_causal_area(world):
    n = 2 * world * 6
    positions = [cp.zigzag_positions(n, r, world) for r in range(world)]
    assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(n))
    assert {cp.causal_area(n, r, world) for r in range(world)} == {n * (n + 1) // (2 * world)}
    x = torch.randn(3, n)
    for r in range(world):
        assert torch.equal(cp.shard_sequence(x, 1, r, world), x[:, positions[r]])
    blocks = [cp.local_query_blocks(n, 3, r, world) for r in range(world)]
    assert torch.equal(torch.sort(torch.cat(blocks)).values, torch.arange(n // 3))
    for r in range(world):  # local block i holds exactly the local rows i*BQ .. (i+1)*BQ-1
        assert torch.equal((blocks[r].view(-1, 1) * 3 + torch.arange(3)).view(-1), positions[r])


@pytest.mark.parametrize(
    "n,world,bq,bk", [(60, 2, 8, 8), (64, 2, 8, 12), (63, 1, 1, 1)], ids=["not-whole-blocks", "lcm", "odd-N"]
)
def test_layout_rejects_lengths_that_do_not_split_into_whole_blocks(n, world, bq, bk):
    with pytest.raises(ValueError, match=rf"N={n} must be a multiple of 2 \* W"):
        cp.check_layout(n, world, bq, bk)


def test_zigzag_helpers_reject_bad_rank():
    with pytest.raises(ValueError, match="rank must lie in"):
        cp.zigzag_positions(16, 2, 2)
    with pytest.raises(ValueError, match="rank"):
        cp.shard_sequence(torch.zeros(16), 0, -1, 2)


def test_attention_without_a_process_group_or_with_a_bad_backend_raises():
    q, k, v = make_qkv(1, 2, 1, 16, 4)
    index = random_index(1, 1, 32, 8, 8, 1, 1, 0)
    with pytest.raises(ValueError, match="backend must be one of"):
        cp.context_parallel_sparse_attention(q, k, v, index, backend="cuda")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="initialised torch.distributed process group"):
            cp.context_parallel_sparse_attention(q, k, v, index)


def test_reference_query_blocks_compute_exactly_the_listed_rows():
    """The reference's query-block map (the CP attention's engine): any subset of query blocks in any order,
    including the partial last block, gives exactly those rows of the full call, with seq_lens, documents and
    dropout; its argument errors."""
    n = 45
    q, k, v = make_qkv(2, 4, 2, n, 6, dtype=torch.float64, seed=5)
    index = random_index(2, 2, n, 8, 4, 2, 1, 1, seed=4)
    docs = ids_from_starts([[0, 10, 30], [0]], n)
    kwargs = dict(dropout_p=0.25, dropout_seed=9, seq_lens=torch.tensor([45, 30]), document_ids=docs)
    o, lse = reference_sparse_attention(q, k, v, index, **kwargs)
    blocks = torch.tensor([5, 1, 3])
    rows = torch.cat([torch.arange(8 * b, min(8 * b + 8, n)) for b in blocks.tolist()])
    o_sub, lse_sub = reference_sparse_attention(q[:, :, rows], k, v, index, query_blocks=blocks, **kwargs)
    assert rel_err(o_sub, o[:, :, rows]) <= FP64_REL and rel_err(lse_sub, lse[:, :, rows]) <= FP64_REL
    with pytest.raises(ValueError, match="must hold the 21 rows"):
        reference_sparse_attention(q[:, :, :20], k, v, index, query_blocks=blocks)
    with pytest.raises(ValueError, match="distinct"):
        reference_sparse_attention(q[:, :, :16], k, v, index, query_blocks=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"in \[0, NQB=6\)"):
        reference_sparse_attention(q[:, :, :8], k, v, index, query_blocks=torch.tensor([6]))
    with pytest.raises(ValueError, match="integer dtype"):
        reference_sparse_attention(q[:, :, :8], k, v, index, query_blocks=torch.tensor([1.0]))
