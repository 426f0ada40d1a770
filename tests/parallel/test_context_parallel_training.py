"""Context parallelism in training (phase 2): ``SparseAttention`` and the ``Transformer`` with
``enable_context_parallel`` on two CPU processes (gloo, reference backend) against one process on the same
global tensors, and the refusals. The Lightning fit with ``cp=2`` is in ``test_context_parallel_fit.py``.

One spawn runs every two-process case; the workers save their local results and the tests here compare them
with the single-process computation. Inputs are float64; the selector scores and distils in float32 whatever
the input dtype, so its loss and parameter gradients are compared at float32 precision (the ranks sum other
rows in another order), everything else at 1e-12.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from builders import ids_from_starts, make_qkv, rel_err, spawn_ranks, value_errors_of
from torch.utils.checkpoint import checkpoint

import sparse_train as st
import sparse_train.parallel.context_parallel as cp
from sparse_train.lightning.model import Transformer, TransformerConfig
from sparse_train.validation import draw_dropout_seed

WORLD = 2
FP64_REL = 1e-12
FP32_TOL = dict(rtol=2e-5, atol=2e-6)
B, HQ, HKV, N, D = 2, 4, 2, 64, 8
BASE = dict(
    selector="pooled",  # 8-token blocks: the pooled scorer's cases; TOKEN below names the token selector's
    block_q=8,
    block_k=8,
    top_k=2,
    window=1,
    sinks=1,
    backend="reference",
    selector_dim=4,
    selector_rope_theta=100.0,
    selector_distance_bias=True,
    key_pooling="mean_max",
    distill_query_blocks=3,
    dense_fallback=False,
    dense_warmup_steps=0,
)

# (id, config overrides, extras): extras "warmup" runs the dense warm-up path; "seq_lens", "documents" global;
# "checkpoint" runs the call under activation checkpointing (replay); "dropout" adds attention dropout; "n" the length
# (default N); "nan_padding" puts NaN in k and v past seq_lens.
MODULE_CASES = [
    ("sparse_sampled", dict(distill="sampled"), {}),
    ("sparse_dense_target", dict(distill="dense"), {"seq_lens": [64, 45]}),
    ("sparse_query_max", dict(distill="dense", query_pooling="mean_max"), {}),
    ("sparse_sparse_target", dict(distill="sparse"), {"documents": [[0, 5, 21, 40], [0, 33]]}),
    ("warmup_sampled", dict(distill="sparse", dense_warmup_steps=5), {"seq_lens": [64, 50]}),
    ("warmup_documents", dict(distill="dense", dense_warmup_steps=5), {"documents": [[0, 5, 21, 40], [0, 33]]}),
    ("checkpoint_replay", dict(distill="sampled", distill_support="causal"), {"checkpoint": True}),
    ("dropout", dict(distill="sparse", dropout_p=0.2), {}),
]
# The token selector (blocks of its kernels' sizes, so N = 128: eight query blocks, four per rank), two index heads:
# block-level and token-level KL, candidates, every distillation target, the warm-up path and checkpoint replay.
TOKEN = dict(
    selector="token",
    selector_distill="block",
    selector_candidates=None,
    block_q=16,
    block_k=16,
    selector_index_heads=2,
)
TOKEN_KL = dict(TOKEN, selector_distill="token", selector_distance_bias=False)  # the token KL reads no distance bias
MODULE_CASES += [
    (
        "token_sampled_block_kl_nan_padding",
        dict(TOKEN, distill="sampled"),
        {"n": 128, "seq_lens": [128, 75], "nan_padding": True},
    ),
    ("token_sampled_token_kl_documents", dict(TOKEN_KL), {"n": 128, "documents": [[0, 5, 40, 90], [0, 70]]}),
    (
        "token_candidates_token_kl_checkpoint",
        dict(TOKEN_KL, selector_candidates=2),
        {"n": 128, "seq_lens": [128, 100], "checkpoint": True, "nan_padding": True},
    ),
    ("token_block_kl_checkpoint_documents", dict(TOKEN), {"n": 128, "checkpoint": True, "documents": [[0, 70], [0]]}),
    ("token_dense_target", dict(TOKEN, distill="dense"), {"n": 128, "seq_lens": [128, 75]}),
    ("token_sparse_target", dict(TOKEN, distill="sparse"), {"n": 128}),
    ("token_warmup_token_kl", dict(TOKEN_KL, dense_warmup_steps=5), {"n": 128, "seq_lens": [128, 90]}),
]
TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
MODEL_SPARSE = dict(
    selector="pooled",
    block_q=8,
    block_k=8,
    top_k=1,
    window=1,
    sinks=1,
    backend="reference",
    dense_warmup_steps=0,
    distill="sampled",
    distill_query_blocks=3,
    dense_fallback=False,
)
# (id, attention, activation checkpointing, documents, sparse config overrides)
MODEL_CASES = [
    ("sparse", "sparse", False, None, {}),
    ("sparse_ckpt_documents", "sparse", True, [[0, 13, 40], [0, 30]], {}),
    ("dense_documents", "dense", False, [[0, 13, 40], [0, 30]], {}),
    (
        "token_ckpt_documents",
        "sparse",
        True,
        [[0, 13, 40], [0, 30]],
        dict(
            selector="token",
            selector_distill="token",
            selector_candidates=None,
            selector_distance_bias=False,
            block_q=16,
            block_k=16,
        ),
    ),
]


def _module(config):
    torch.manual_seed(5)
    module = st.SparseAttention(st.SparseAttentionConfig(**{**BASE, **config}), HQ, HKV, D).double()
    with torch.no_grad():  # a trained-looking selector: every term non-zero
        for p in module.scorer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module.train()


def _module_inputs(extras):
    n = extras.get("n", N)
    q, k, v = make_qkv(B, HQ, HKV, n, D, dtype=torch.float64, seed=17)
    grad_out = torch.randn(B, HQ, n, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    seq_lens = torch.tensor(extras["seq_lens"]) if "seq_lens" in extras else None
    docs = ids_from_starts(extras["documents"], n) if "documents" in extras else None
    if extras.get("nan_padding"):  # keys and values past a length are masked everywhere: NaN there reaches nothing
        past = torch.arange(n).view(1, 1, n, 1) >= seq_lens.view(-1, 1, 1, 1)
        k, v = (torch.where(past, float("nan"), t) for t in (k, v))
    return q, k, v, grad_out, seq_lens, docs


def _run_module(module, q, k, v, grad_out, seq_lens, docs, use_checkpoint, seed=None):
    """One training call and its backward: (o, dq, dk, dv, selector loss, scorer grads)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if seed is not None:
        torch.manual_seed(seed)
    if use_checkpoint:
        o = checkpoint(lambda *a: module(*a, document_ids=docs), q, k, v, seq_lens, use_reentrant=False)
    else:
        o = module(q, k, v, seq_lens, document_ids=docs)
    loss = (o * grad_out).sum() + module.selector_loss
    loss.backward()
    return dict(
        o=o.detach(),
        dq=q.grad,
        dk=k.grad,
        dv=v.grad,
        selector_loss=module.selector_loss.detach(),
        grads={n: p.grad.clone() for n, p in module.scorer.named_parameters()},
        path=module._last_path,
        replay=module._replay.stats(),
    )


def _tiny_model(attention, ckpt, sparse=None):
    torch.manual_seed(0)
    sparse = {**MODEL_SPARSE, **(sparse or {})} if attention == "sparse" else {}
    cfg = TransformerConfig(**TINY, attention=attention, sparse=sparse, activation_checkpointing=ckpt)
    return Transformer(cfg).double().train()


def _model_inputs(docs):
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, TINY["vocab_size"], (2, N), generator=g)
    labels = torch.randint(0, TINY["vocab_size"], (2, N), generator=g)
    labels[:, ::3] = -100
    return tokens, labels, (ids_from_starts(docs, N) if docs is not None else None)


def _run_model(model, tokens, labels, docs, count):
    """Logits and parameter gradients of (labelled-token CE sum / the global count + selector losses)."""
    logits = model(tokens, document_ids=docs)
    mask = labels != -100
    loss = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum") / count
    (loss + st.collect_selector_losses(model)).backward()
    return dict(logits=logits.detach(), grads={n: p.grad.clone() for n, p in model.named_parameters()})


# --------------------------------------------------------------------------------------------- the workers
def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {"module": {}, "model": {}}
    for name, config, extras in MODULE_CASES:
        module = _module(config)
        cp.enable_context_parallel(module)
        q, k, v, grad_out, seq_lens, docs = _module_inputs(extras)
        local = [cp.shard_sequence(t, 2, rank, WORLD) for t in (q, k, v, grad_out)]
        results["module"][name] = _run_module(
            module, *local, seq_lens, docs, extras.get("checkpoint", False), seed=100 + rank
        )  # a rank-dependent global RNG: the seed is shared
    for name, attention, ckpt, doc_starts, sparse in MODEL_CASES:
        model = _tiny_model(attention, ckpt, sparse)
        cp.enable_context_parallel(model)
        tokens, labels, docs = _model_inputs(doc_starts)
        count = (labels != -100).sum()
        local_tokens, local_labels = (cp.shard_sequence(t, 1, rank, WORLD) for t in (tokens, labels))
        results["model"][name] = _run_model(model, local_tokens, local_labels, docs, count)

    module = _module(dict(distill="sampled"))
    cp.enable_context_parallel(module)
    q, k, v, _, _, _ = _module_inputs({})
    ql, kl, vl = (cp.shard_sequence(t, 2, rank, WORLD) for t in (q, k, v))
    metrics = _module(dict(metrics_every=1))
    cp.enable_context_parallel(metrics)
    model = _tiny_model("sparse", False)
    cp.enable_context_parallel(model)
    results["errors"] = value_errors_of(
        [
            lambda: module(ql[:, :, :20], kl[:, :, :20], vl[:, :, :20]),  # N = 40: not whole chunks of blocks
            lambda: module(ql, kl, vl, torch.tensor([64])),  # seq_lens of another batch
            lambda: module(ql, kl, vl, document_ids=torch.zeros(2, 32, dtype=torch.int64)),  # local, not global
            lambda: module(ql, kl, vl, position_ids=torch.arange(32)),  # local positions
            lambda: metrics(ql, kl, vl),
            lambda: module.decode(ql, kl, vl),
            lambda: model(torch.zeros(2, 30, dtype=torch.int64)),  # N = 60 is not a multiple of 2 * W * 8
            lambda: cp.enable_context_parallel(torch.nn.Linear(2, 2)),
            lambda: cp.enable_context_parallel(_module(dict(selector="oracle", distill="off"))),
        ]
    )
    dist.barrier()  # no rank is left inside a collective by the refused calls
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel_training")
    spawn_ranks(_worker, WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# --------------------------------------------------------------------------------------------- SparseAttention
@pytest.mark.parametrize("case", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_sparse_attention_under_cp_equals_one_process(two_ranks, case):
    """``SparseAttention`` with ``enable_context_parallel`` on two ranks, against the same module (same seed)
    on the global tensors: each rank's output and q/k/v gradients are its rows of the single-process ones
    (float64, 1e-12), on the sparse path and on the dense warm-up path, with seq_lens, packed documents,
    activation checkpointing (the recompute replays the first forward's selection and sampled blocks) and
    dropout (seed shared by broadcast, bits at global positions); the ranks' selector losses and selector
    parameter gradients SUM to the single-process loss and gradients (every distillation target: sampled,
    dense, sparse, and sampled on the dense path). The token selector likewise: its index keys from the
    all-gathered un-rotated keys, the block-level KL of its sampled blocks (scored apart, those of other ranks on
    placeholder rows) and the token-level KL (every held sampled row against all keys, over the count of every
    sampled row), with candidates, NaN padding, documents and checkpoint replay."""
    name, config, extras = case
    q, k, v, grad_out, seq_lens, docs = _module_inputs(extras)
    got = [r["module"][name] for r in two_ranks]
    with mock.patch("sparse_train.module.attention.draw_dropout_seed", return_value=_rank0_seed()):
        want = _run_module(_module(config), q, k, v, grad_out, seq_lens, docs, extras.get("checkpoint", False))
    expected_path = "dense" if config.get("dense_warmup_steps") else "sparse"
    for rank, result in enumerate(got):
        assert result["path"] == want["path"] == expected_path
        for key in ("o", "dq", "dk", "dv"):
            local = cp.shard_sequence(want[key], 2, rank, WORLD)
            error = rel_err(result[key], local)
            assert error <= FP64_REL, f"rank {rank} {key}: relative error {error:.2e}"
    torch.testing.assert_close(sum(r["selector_loss"] for r in got), want["selector_loss"], **FP32_TOL)
    assert float(want["selector_loss"]) > 0
    for pname, grad in want["grads"].items():
        summed = sum(r["grads"][pname] for r in got)
        # Error relative to the tensor's largest entry: the two ranks' float32 partial sums add in another
        # order than one process sums, and an entry where large terms cancel (the query max-pooling
        # features are all positive, so their gradients reach ~4e3) keeps the absolute rounding of the
        # terms, not of itself. Measured: at most 4.3e-7 of the largest entry in every case.
        scale = float(grad.abs().max())
        assert scale > 0, pname
        error = float((summed - grad).abs().max()) / scale
        assert error <= 2e-6, f"{pname}: error {error:.2e} of the largest entry {scale:.3g}"
    if extras.get("checkpoint"):
        for result in got:
            assert result["replay"]["replay/hits"] >= 1 and result["replay"]["replay/misses"] == 0


def _rank0_seed() -> int:
    """The dropout seed the two ranks share: rank 0's module draws its first seed from torch's global RNG, which
    the worker seeded with 100 (rank 1 with 101: a seed drawn per rank would differ), and ``shared_dropout_seed``
    broadcasts it."""
    torch.manual_seed(100)
    return draw_dropout_seed()


# --------------------------------------------------------------------------------------------- Transformer
@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_transformer_under_cp_equals_one_process(two_ranks, case):
    """The repository's ``Transformer`` on the zig-zag shards of the tokens (RoPE at the global positions of
    the local rows, restarting per document): each rank's logits are its rows of the single-process logits
    (1e-12), and the parameter gradients of (its labelled tokens' CE sum / the global count + its selector
    losses), summed over the ranks, are the single-process gradients: the model's at 1e-10 relative, the
    selectors' at float32 precision. Sparse, sparse with activation checkpointing and packed documents,
    the dense twin with documents, and the token selector (token-level KL) with checkpointing and documents."""
    name, attention, ckpt, doc_starts, sparse = case
    tokens, labels, docs = _model_inputs(doc_starts)
    want = _run_model(_tiny_model(attention, ckpt, sparse), tokens, labels, docs, (labels != -100).sum())
    got = [r["model"][name] for r in two_ranks]
    for rank, result in enumerate(got):
        local = cp.shard_sequence(want["logits"], 1, rank, WORLD)
        assert rel_err(result["logits"], local) <= FP64_REL, rank
    for pname, grad in want["grads"].items():
        summed = sum(r["grads"][pname] for r in got)
        if ".core." in pname:
            torch.testing.assert_close(summed, grad, **FP32_TOL, msg=lambda m: f"{pname}: {m}")
        else:
            assert rel_err(summed, grad) <= 1e-10, pname


def test_refusals_under_cp(two_ranks):
    """Every unsupported call raises a ValueError naming the problem, before any collective (the workers
    reach the barrier after them): a length that does not split into 2W chunks of whole blocks, seq_lens /
    document_ids / position_ids that are not the global ones, metrics_every > 0, decode, a model with an
    odd-length shard, a model with nothing that supports CP, a module with the oracle selector."""
    expected = [
        "multiple of 2 * W",
        "seq_lens has 1 entries",
        "document_ids must have shape",
        "GLOBAL positions",
        "metrics_every",
        "decode: not supported under context parallelism",
        "multiple of 2 * W",
        "no module that supports context parallelism",
        "not the oracle selector",
    ]
    for result in two_ranks:
        assert len(result["errors"]) == len(expected)
        for message, want in zip(result["errors"], expected):
            assert want in message, (want, message)


def test_enable_context_parallel_needs_a_process_group():
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="initialised torch.distributed process group"):
            cp.enable_context_parallel(_module({}))


@pytest.mark.parametrize("documents", [False, True], ids=["plain", "documents"])
def test_scorer_and_selection_on_a_subset_of_query_blocks(documents):
    """``query_blocks=`` (the global ids of the rows held, in any order): the scorer's logits (distance bias
    included) are those rows of the full call (up to the float32 rounding of a matmul over fewer rows, whose
    blocking the BLAS may choose differently), and the candidates picked from them are exactly the candidates of
    those rows in a full call on the same logits (with seq_lens, documents and top_p); a float map or one of the
    wrong length is refused."""
    from sparse_train.selection.scorer import BlockScorer, selection_candidates, selection_geometry

    torch.manual_seed(3)
    scorer = BlockScorer(HQ, HKV, D, 4, key_pooling="mean_max", distance_bias=True)
    with torch.no_grad():
        for p in scorer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    q, k, _ = make_qkv(B, HQ, HKV, N, D, seed=4)
    geometry = selection_geometry(N, 8, 8, 2, 1, 1)
    seq_lens = torch.tensor([64, 45])
    docs = ids_from_starts([[0, 5, 21, 40], [0, 33]], N) if documents else None
    qbar, kbar = scorer.pool(q, k, 8, 8, seq_lens)
    full = scorer(qbar, kbar, 0.3, geometry)
    rows = torch.tensor([5, 0, 7, 3])
    sub = scorer(qbar[:, :, rows], kbar, 0.3, geometry, query_blocks=rows)
    torch.testing.assert_close(sub, full[:, :, rows], rtol=1e-6, atol=1e-6)
    kwargs = dict(window=1, sinks=1, seq_lens=seq_lens, document_ids=docs, top_p=0.9)
    spliced = full.detach().clone()
    spliced[:, :, rows] = sub.detach()
    want = selection_candidates(spliced, geometry, **kwargs)[:, :, rows]
    assert torch.equal(selection_candidates(sub, geometry, query_blocks=rows, **kwargs), want)
    with pytest.raises(ValueError, match="query_blocks must have an integer dtype, got torch.float32"):
        selection_candidates(sub, geometry, query_blocks=rows.float(), **kwargs)
    with pytest.raises(ValueError, match=r"query_blocks must be 1-D, got shape \(1, 4\)"):
        scorer(qbar[:, :, rows], kbar, 0.3, geometry, query_blocks=rows.view(1, 4))
    with pytest.raises(ValueError, match="lists 3 query blocks but the scores hold 4 rows"):
        scorer(qbar[:, :, rows], kbar, 0.3, geometry, query_blocks=rows[:3])


@pytest.mark.parametrize(
    "deterministic,fused,stored,gluon",
    [(True, False, True, False), (False, True, False, True)],
    ids=["deterministic-stored-ds-triton-only", "fused-gluon"],
)
def test_cp_module_passes_its_kernel_settings(monkeypatch, deterministic, fused, stored, gluon):
    """Under context parallelism the module hands ``deterministic`` and its ``kernel_options`` to the attention as
    the single-process path does (a deterministic config must not run the atomic backward under CP). One process,
    a world-1 gloo group."""
    if dist.is_initialized():
        pytest.skip("needs to create its own process group")
    seen = []
    original = cp.context_parallel_sparse_attention

    def recording(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("deterministic", "kernel_options")})
        return original(*args, **kwargs)

    monkeypatch.setattr(cp, "context_parallel_sparse_attention", recording)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module = _module(
            dict(
                distill="sampled",
                deterministic=deterministic,
                kernel_options=dict(
                    r0=3, fused_dq=fused, stored_ds=stored, fwd_gluon=gluon, dq_gluon=gluon, kv_gluon=gluon
                ),
            )
        )
        cp.enable_context_parallel(module)
        q, k, v = make_qkv(B, HQ, HKV, N, D, dtype=torch.float64, seed=1)
        module(q, k, v)
    finally:
        dist.destroy_process_group()
    assert seen == [
        {
            "deterministic": deterministic,
            "kernel_options": {
                "r0": 3,
                "fused_dq": fused,
                "stored_ds": stored,
                "fwd_gluon": gluon,
                "dq_gluon": gluon,
                "kv_gluon": gluon,
            },
        }
    ]
