"""The selector -> index -> plan -> kernels path reads nothing back to the host.

* The plan and the KV-centric schedule have shapes fixed by the index's shape; they must equal what the
  previous, exactly-sized implementation produced (its algorithm is kept below as the oracle) on the
  real prefix, with padding the kernels skip, and the backward must give bitwise the same gradients.
* A dispatch-mode detector fails on every operation that needs a device -> host read on CUDA (a scalar
  read, ``nonzero``, a boolean-mask index, ``tolist``...), run here on CPU tensors: the module's
  training step (sparse path, distillation on) at the CUDA defaults, and the Triton op with
  ``check_values=False``.
* The functional API keeps its value checks by default.
GPU-only: ``tests/test_compile.py`` (sync-debug mode, CUDA-graph capture)."""

import math

import pytest
import torch
from builders import make_qkv, random_selection
from torch.utils._python_dispatch import TorchDispatchMode

import sparse_train as st
from sparse_train.index.block_index import canonicalize
from sparse_train.kernels.reference import index_scores as index_score_reference
from sparse_train.kernels.triton import backward as kbackward
from sparse_train.kernels.triton.op import triton_sparse_attention
from sparse_train.plan import plan as plan_mod
from sparse_train.selection import draw_query_blocks

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------- detector
class HostReads(TorchDispatchMode):
    """Records every aten call that reads device values back to the host on CUDA (a synchronisation,
    and a CUDA-graph capture error) or whose output shape depends on values."""

    SYNCING = {
        aten._local_scalar_dense.default,
        aten.is_nonzero.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten.item.default,
    }

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        bad = func in self.SYNCING or "unique" in name
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            bad = True
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            bad = True
        if bad:
            self.calls.append(name)
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch):
    """A :class:`HostReads` recorder; ``Tensor.tolist`` (which reads CPU memory without a dispatch)
    is recorded too while it is active."""
    recorder = HostReads()
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        if recorder.active:
            recorder.calls.append("Tensor.tolist")
        return real_tolist(self)

    recorder.active = False
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return recorder


class _Active:
    def __init__(self, recorder):
        self.recorder = recorder

    def __enter__(self):
        self.recorder.active = True
        self.recorder.__enter__()
        return self.recorder

    def __exit__(self, *exc):
        self.recorder.active = False
        return self.recorder.__exit__(*exc)


def test_detector_sees_the_reads_it_looks_for(host_reads):
    t = torch.tensor([1, 0, 2])
    with _Active(host_reads):
        int(t.max())
        t[t > 0]
        t.tolist()
        bool(t.any())
    assert host_reads.calls.count("aten._local_scalar_dense.default") == 2
    assert "aten.index.Tensor" in host_reads.calls and "Tensor.tolist" in host_reads.calls


# ---------------------------------------------------------------------------------------------- oracle
def exact_size_plan(indices, num_k_blocks, r0):
    """The plan with exact sizes, boolean-mask compaction and host-read stats (a straightforward oracle)."""
    b, h, nqb, _ = indices.shape
    idx = indices.to(torch.int64)
    valid = idx >= 0
    bh = torch.arange(b * h).view(b, h, 1, 1)
    qi = torch.arange(nqb).view(1, 1, nqb, 1)
    key, _ = torch.sort(((bh * num_k_blocks + idx) * nqb + qi)[valid])
    kv_indptr = torch.searchsorted(key, torch.arange(b * h * num_k_blocks + 1) * nqb)
    reuse = (kv_indptr[1:] - kv_indptr[:-1]).view(b, h, num_k_blocks)
    hot = (reuse >= r0) & (reuse > 0)
    return dict(
        reuse=reuse.to(torch.int32),
        kv_indptr=kv_indptr,
        kv_qblocks=(key % nqb).to(torch.int32),
        hot=hot,
        num_hot=int(hot.sum()),
        num_cold=int(((reuse > 0) & ~hot).sum()),
        nnz=key.numel(),
        max_count=int((idx >= 0).sum(-1).max()) if idx.numel() else 0,
        max_reuse=int(reuse.max()) if reuse.numel() else 0,
    )


def exact_size_kv_schedule(reuse, kv_indptr, slots, chunk):
    """The KV-centric schedule with the exact number of items and partials (a straightforward oracle)."""
    reuse = reuse.reshape(-1).to(torch.int64)
    kv_centric = (slots < 0) & (reuse > 0)
    num_chunks = torch.where(kv_centric, (reuse + chunk - 1) // chunk, 0)
    multi = num_chunks >= 2
    chunks_of_multi = torch.where(multi, num_chunks, 0)
    rows = torch.repeat_interleave(torch.arange(reuse.numel()), num_chunks)
    first_item = torch.cumsum(num_chunks, 0) - num_chunks
    c = torch.arange(rows.numel()) - first_item[rows]
    start = kv_indptr[:-1][rows] + c * chunk
    end = torch.minimum(start + chunk, kv_indptr[1:][rows])
    part_start = torch.cumsum(chunks_of_multi, 0) - chunks_of_multi
    item_part = torch.where(multi[rows], part_start[rows] + c, -1)
    return (
        rows,
        start,
        end,
        item_part,
        torch.where(multi, part_start, -1),
        torch.where(reuse > 0, chunks_of_multi, -1),
        int(chunks_of_multi.sum()),
    )


def _ids_from_lengths(lengths, seq_len):
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.cat([ids, ids.new_full((seq_len - ids.numel(),), len(lengths) - 1)])[:seq_len].view(1, -1)


CASES = [
    # id, (B, HKV, N, BQ, BK, top_k, window, sinks), selection options, documents
    pytest.param((2, 3, 517, 32, 32, 5, 2, 1), {}, None, id="gqa-odd-length"),
    pytest.param((1, 2, 300, 16, 32, 4, 0, 0), {"empty_rows": True}, None, id="empty-rows"),
    pytest.param((1, 1, 333, 32, 16, 6, 1, 2), {"distinct": False, "duplicates": True}, None, id="duplicates-bq-ne-bk"),
    pytest.param((1, 2, 400, 32, 32, 3, 2, 1), {}, [150, 7, 243], id="documents"),
    pytest.param((1, 2, 250, 16, 16, 0, 16, 0), {}, None, id="full-causal"),
]


def _index(shape, options, lengths, seed, capacity=None, check="cheap"):
    b, hkv, n, bq, bk, top_k, window, sinks = shape
    sel = random_selection(b, hkv, n, bq, bk, top_k, seed=seed, **options)
    ids = None if lengths is None else _ids_from_lengths(lengths, n).expand(b, -1)
    return st.BlockIndex.from_selection(
        sel,
        seq_len=n,
        block_q=bq,
        block_k=bk,
        window=window,
        sinks=sinks,
        capacity=capacity,
        check=check,
        document_ids=ids,
    )


@pytest.mark.parametrize("r0", [1, 3], ids=lambda r: f"r0={r}")
@pytest.mark.parametrize("shape,options,lengths", CASES)
def test_plan_equals_the_exact_size_plan(shape, options, lengths, r0):
    index = _index(shape, options, lengths, seed=sum(shape))
    plan = index.plan(r0)
    want = exact_size_plan(index.indices, index.num_k_blocks, r0)
    for name in ("reuse", "kv_indptr", "hot"):
        assert torch.equal(getattr(plan, name), want[name]), name
    nnz = want["nnz"]
    assert plan.kv_qblocks.numel() == index.indices.numel(), "one entry per index slot (a shape, not a count)"
    assert torch.equal(plan.kv_qblocks[:nnz], want["kv_qblocks"])
    assert (plan.kv_qblocks[nnz:] == -1).all()
    for name in ("num_hot", "num_cold", "nnz", "max_count", "max_reuse"):
        assert getattr(plan, name) == want[name], name
    if shape[5] == 0:  # the full causal index
        assert index.is_full()


@pytest.mark.parametrize("chunk", [1, 2, 5], ids=lambda c: f"chunk={c}")
@pytest.mark.parametrize("shape,options,lengths", CASES)
def test_kv_schedule_equals_the_exact_size_one_within_its_bounds(shape, options, lengths, chunk):
    index = _index(shape, options, lengths, seed=7 * sum(shape))
    plan = index.plan(3)
    slots = plan_mod.cold_slots(plan.hot, plan.reuse, False)
    want = exact_size_kv_schedule(plan.reuse, plan.kv_indptr, slots, chunk)
    items, parts = plan_mod.kv_schedule_capacity(plan.reuse.numel(), index.num_q_blocks, index.indices.numel(), chunk)
    got = plan_mod.kv_schedule(plan.reuse, plan.kv_indptr, slots, chunk, num_items=items, num_parts=parts)
    real = want[0].numel()
    assert real <= items and want[6] <= parts, "the shape bounds must hold"
    assert got.item_row.numel() == items and got.total_parts == parts
    for g, w in zip(got[:4], want[:4]):
        assert torch.equal(g[:real].long(), w.long())
    assert (got.item_row[real:] == -1).all()
    assert torch.equal(got.part_start.long(), want[4].long()) and torch.equal(got.num_parts.long(), want[5].long())


@pytest.mark.parametrize("chunk", [1, 3, 4], ids=lambda c: f"chunk={c}")
def test_kv_schedule_bounds_hold_at_their_worst_case(chunk):
    """Every KV row selected by chunk + 1 query blocks (the most partials per pair) and every row by all
    query blocks (the most items per row): the bounds hold, and the partial bound is reached."""
    nqb, nkb = 4 * (chunk + 1), 3
    for reuse_per_row in (chunk + 1, nqb):
        reuse = torch.full((nkb,), reuse_per_row, dtype=torch.int64)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(reuse, 0)])
        slots = torch.full((nkb,), -1, dtype=torch.int32)
        exact = plan_mod.kv_schedule(reuse, indptr, slots, chunk)
        items, parts = plan_mod.kv_schedule_capacity(nkb, nqb, int(reuse.sum()), chunk)
        assert exact.item_row.numel() <= items and exact.total_parts <= parts
    pairs = nkb * (chunk + 1)
    assert plan_mod.kv_schedule_capacity(nkb, nqb, pairs, chunk)[1] == 2 * pairs // (chunk + 1) == 2 * nkb


def test_plan_of_an_empty_batch():
    empty = st.BlockIndex.from_selection(
        torch.zeros(0, 2, 3, 1, dtype=torch.int64), seq_len=96, block_q=32, block_k=32, capacity=2, check="none"
    )
    plan = empty.plan()
    assert plan.kv_indptr.tolist() == [0] and plan.nnz == 0 and plan.max_count == 0
    schedule = plan_mod.kv_schedule(
        plan.reuse, plan.kv_indptr, plan_mod.cold_slots(plan.hot, plan.reuse, False), 2, num_items=0, num_parts=0
    )
    assert schedule.item_row.numel() == 0


@pytest.mark.parametrize("r0,deterministic", [(2, False), (2, True)], ids=["atomic-cold", "deterministic"])
def test_backward_with_padded_schedule_equals_exact_schedule(monkeypatch, small_kv_chunks, r0, deterministic):
    """The padded KV-centric grid (items past the real ones return at once) gives bitwise the gradients of
    the exactly-sized grid, chunked rows and the atomic path included."""
    B, HQ, HKV, N, D = 1, 4, 2, 150, 16
    sel = random_selection(B, HKV, N, 16, 16, 3, seed=4)
    index = st.BlockIndex.from_selection(sel, seq_len=N, block_q=16, block_k=16, window=2, sinks=1)
    q, k, v = make_qkv(B, HQ, HKV, N, D, seed=4)
    do = torch.randn(B, HQ, N, D, generator=torch.Generator().manual_seed(5))

    def grads():
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = triton_sparse_attention(qs, ks, vs, index, deterministic=deterministic, kernel_options={"r0": r0})[0]
        return torch.autograd.grad(o, (qs, ks, vs), do)

    padded = grads()
    seen = []
    real_schedule = kbackward.kv_schedule

    def exact(reuse, kv_indptr, slots, chunk=None, **bounds):
        seen.append(bounds)
        return real_schedule(reuse, kv_indptr, slots, chunk)  # sized by reading the totals

    monkeypatch.setattr(kbackward, "kv_schedule", exact)
    for got, want in zip(padded, grads()):
        assert torch.equal(got, want)
    assert seen and seen[0]["num_items"] > 0, "the launcher passes its shape bounds"


# ---------------------------------------------------------------------------------------------- no host reads
MODULE_CASES = [
    # (selector, backend, distill, seq_lens, documents, r0); "token" is the default selector (token-level KL; at
    # these lengths exact scores), "token-candidates" the same with candidate blocks, "token-exact" the token
    # selector with exact scores and the block-level KL
    pytest.param("pooled", "triton", "sampled", False, False, 1, id="pooled-triton-sampled"),
    pytest.param("pooled", "triton", "sparse", True, True, 2, id="pooled-triton-sparse-seq_lens-documents-r0=2"),
    pytest.param("pooled", "reference", "sampled", True, True, 1, id="pooled-reference-sampled-seq_lens-documents"),
    pytest.param("token", "triton", "sampled", False, False, 1, id="token-triton-sampled"),
    pytest.param("token", "triton", "sampled", True, True, 1, id="token-triton-sampled-seq_lens-documents"),
    pytest.param("token-candidates", "triton", "sampled", False, False, 1, id="token-candidates-triton-sampled"),
    pytest.param(
        "token-candidates", "triton", "sampled", True, True, 1, id="token-candidates-triton-sampled-seq_lens-documents"
    ),
    pytest.param("token-exact", "triton", "sampled", True, False, 1, id="token-exact-triton-sampled-seq_lens"),
]
SELECTOR_SETTINGS = {
    "pooled": dict(selector="pooled"),
    "token": dict(),
    "token-candidates": dict(selector_candidates=4),
    "token-exact": dict(selector_distill="block", selector_candidates=None),
}


@pytest.mark.parametrize("selector,backend,distill,with_lens,with_docs,r0", MODULE_CASES)
def test_module_training_step_reads_nothing_back(
    monkeypatch, host_reads, selector, backend, distill, with_lens, with_docs, r0
):
    """A training step of the module (sparse path, distillation on, forward and backward, selector
    loss included) at the CUDA defaults (index_check="none": value checks are skipped there; on CPU
    they run, so the rule is forced here, for the token selector's PyTorch references too) makes no host read."""
    monkeypatch.setattr(st.SparseAttention, "_checks_values", lambda self, device: False)
    monkeypatch.setattr(index_score_reference, "checks_values", lambda device: False)
    cfg = st.SparseAttentionConfig(
        **SELECTOR_SETTINGS[selector],
        block_q=16,
        block_k=16,
        top_k=2,
        window=1,
        sinks=1,
        selector_dim=8,
        kernel_options={"r0": r0},
        dense_warmup_steps=0,
        distill=distill,
        backend=backend,
    )
    module = st.SparseAttention(cfg, num_heads=4, num_kv_heads=2, head_dim=16).train()
    n = 150
    q, k, v = make_qkv(1, 4, 2, n, 16, seed=3, requires_grad=True)
    lens = torch.tensor([131]) if with_lens else None
    ids = _ids_from_lengths([60, 5, 85], n) if with_docs else None
    with _Active(host_reads):
        out = module(q, k, v, seq_lens=lens, document_ids=ids)
        (out.square().sum() + module.selector_loss).backward()
    assert host_reads.calls == []
    assert module.last_selection is not None and module.selector_loss is not None
    assert all(t.grad is not None for t in (q, k, v))


def test_module_still_checks_values_when_asked(monkeypatch):
    """index_check="cheap" keeps the value checks on every device (the rule is forced to CUDA's)."""
    monkeypatch.setattr(st.SparseAttention, "_checks_values", lambda self, device: self.config.index_check != "none")
    for check, raises in (("cheap", True), ("none", False)):
        cfg = st.SparseAttentionConfig(
            block_q=16, block_k=16, top_k=2, window=1, sinks=1, dense_warmup_steps=0, index_check=check
        )
        module = st.SparseAttention(cfg, num_heads=4, num_kv_heads=2, head_dim=16)
        q, k, v = make_qkv(1, 4, 2, 64, 16)
        if raises:
            with pytest.raises(ValueError, match=r"seq_lens values must lie in \[0, N=64\]"):
                module(q, k, v, seq_lens=torch.tensor([65]))
        else:
            module(q, k, v, seq_lens=torch.tensor([65]))


@pytest.mark.parametrize("r0,deterministic", [(1, False), (2, False)], ids=["r0=1", "r0=2-atomics"])
def test_triton_op_reads_nothing_back_without_value_checks(host_reads, small_kv_chunks, r0, deterministic):
    B, HQ, HKV, N, D = 1, 4, 2, 150, 16
    sel = random_selection(B, HKV, N, 16, 16, 3, seed=9)
    index = st.BlockIndex.from_selection(sel, seq_len=N, block_q=16, block_k=16, window=2, sinks=1)
    q, k, v = make_qkv(B, HQ, HKV, N, D, seed=9, requires_grad=True)
    ids = _ids_from_lengths([70, 80], N)
    with _Active(host_reads):
        o, lse = triton_sparse_attention(
            q,
            k,
            v,
            index,
            seq_lens=torch.tensor([140]),
            document_ids=ids,
            deterministic=deterministic,
            kernel_options={"r0": r0},
            check_values=False,
        )
        o.square().sum().backward()
    assert host_reads.calls == []


def test_functional_api_keeps_its_value_checks_by_default():
    index = st.BlockIndex.full(1, 2, 64, 16, 16)
    q, k, v = make_qkv(1, 4, 2, 64, 16)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=r"seq_lens values must lie in \[0, N=64\]"):
            st.sparse_attention(q, k, v, index, seq_lens=torch.tensor([65]), backend=backend)
        with pytest.raises(ValueError, match="non-decreasing"):
            st.sparse_attention(q, k, v, index, document_ids=torch.arange(64).flip(0).view(1, 64), backend=backend)
        # unchecked: the lengths act clamped to [0, N]
        got = st.sparse_attention(q, k, v, index, seq_lens=torch.tensor([65]), backend=backend, check_values=False)
        torch.testing.assert_close(
            got, st.sparse_attention(q, k, v, index, seq_lens=torch.tensor([64]), backend=backend)
        )
    with pytest.raises(ValueError, match="check_values must be a bool"):
        st.sparse_attention(q, k, v, index, check_values=1)


def test_canonicalize_with_a_capacity_that_fits_every_row_reads_only_its_checks(host_reads):
    """A capacity at least the candidate width cannot be exceeded, so the longest row is never read:
    check="none" reads nothing, check="cheap" only its validation flag; the rows are the automatic
    tier's, padded."""
    sel = random_selection(1, 2, 300, 32, 32, 3, seed=1)
    width = sel.shape[-1] + 2 + 1  # candidates + window + sinks
    results = {}
    for check, reads in (("none", []), ("cheap", ["aten._local_scalar_dense.default"])):
        host_reads.calls.clear()
        with _Active(host_reads):
            results[check] = canonicalize(
                sel, seq_len=300, block_q=32, block_k=32, window=2, sinks=1, capacity=width, check=check
            )
        assert host_reads.calls == reads, check
    auto_indices, auto_counts = canonicalize(sel, seq_len=300, block_q=32, block_k=32, window=2, sinks=1)
    for indices, counts in results.values():
        assert torch.equal(counts, auto_counts) and indices.shape[-1] == width
        assert torch.equal(indices, auto_indices[..., :width]) and (auto_indices[..., width:] == -1).all()
    full = st.BlockIndex.full(2, 1, 200, 32, 16)
    assert full.capacity == math.ceil(200 / 16) and full.is_full()


def test_draw_query_blocks_is_a_device_side_sample_without_replacement(host_reads):
    with _Active(host_reads):
        draws = [draw_query_blocks(37, 8, torch.tensor(d)) for d in range(200)]
    assert host_reads.calls == []
    for picked in draws:
        assert picked.dtype == torch.int64 and picked.numel() == 8
        assert torch.equal(picked, picked.unique()) and 0 <= int(picked.min()) and int(picked.max()) < 37
    assert torch.equal(draws[5], draw_query_blocks(37, 8, torch.tensor(5))), "a pure function of the draw number"
    assert len({tuple(p.tolist()) for p in draws}) == len(draws), "each draw differs"
    hits = torch.bincount(torch.cat(draws), minlength=37).double()
    # 200 draws x 8 of 37: about 43 picks per block; every block is drawn, none dominates
    assert int(hits.min()) > 15 and int(hits.max()) < 80
    assert torch.equal(draw_query_blocks(3, 8, torch.tensor(1)), torch.arange(3))
