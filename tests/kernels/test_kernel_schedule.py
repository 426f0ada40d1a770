"""The backward's KV-centric work list in one kernel (kernels/triton/schedule.py) against its PyTorch reference
(``plan.kv_schedule``): equal arrays for real plans (GQA, odd lengths, empty rows, cold blocks, rows cut into
chunks, sinks selected by every query block), at the shape bounds and at the exact sizes; an empty batch;
validation; the backward on the GPU takes it."""

import pytest
import torch
from builders import random_selection

import sparse_train as st
from sparse_train.kernels.triton.schedule import triton_kv_schedule
from sparse_train.plan import plan as plan_mod

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")


def _plan(b, hkv, n, block, top_k, window, sinks, r0, seed, empty_rows=False):
    sel = random_selection(b, hkv, n, block, block, top_k, seed=seed, empty_rows=empty_rows)
    index = st.BlockIndex.from_selection(
        sel.to(DEV), seq_len=n, block_q=block, block_k=block, window=window, sinks=sinks
    )
    return index, index.plan(r0)


def _reference(plan, slots, chunk, **bounds):
    # the PyTorch path of plan.kv_schedule, on the CPU where it is the only path
    return plan_mod.kv_schedule(plan.reuse.cpu(), plan.kv_indptr.cpu(), slots.cpu(), chunk, **bounds)


CASES = [
    # (B, HKV, N, block, top_k, window, sinks, r0, chunk, empty rows)
    pytest.param(2, 3, 517, 32, 5, 2, 1, 1, 2, False, id="gqa-odd-length-chunk2"),
    pytest.param(1, 2, 2048, 16, 6, 4, 1, 3, 3, False, id="cold-blocks-r0-3"),
    pytest.param(1, 2, 300, 16, 4, 0, 0, 1, 1, True, id="empty-rows-chunk1"),
    pytest.param(1, 1, 4096, 16, 2, 1, 2, 1, 64, False, id="long-sink-rows-default-chunk"),
]


@pytest.mark.parametrize("step", [None, 16], ids=["one-step", "16-row-steps"])
@pytest.mark.parametrize("exact", [False, True], ids=["shape-bounds", "exact-sizes"])
@pytest.mark.parametrize("B,HKV,N,block,top_k,window,sinks,r0,chunk,empty_rows", CASES)
def test_kv_schedule_kernel_equals_reference(
    B, HKV, N, block, top_k, window, sinks, r0, chunk, empty_rows, exact, step, monkeypatch
):
    """16-row steps make the program carry its item and partial counts across many steps, as at 64K and up."""
    if step is not None:
        import sparse_train.kernels.triton.schedule as schedule_module

        monkeypatch.setattr(schedule_module, "_MAX_BLOCK", step)
    index, plan = _plan(B, HKV, N, block, top_k, window, sinks, r0, seed=N + chunk, empty_rows=empty_rows)
    slots = plan_mod.cold_slots(plan.hot, plan.reuse, False)
    if exact:
        want = _reference(plan, slots, chunk)
        items, parts = want.item_row.numel(), want.total_parts
    else:
        items, parts = plan_mod.kv_schedule_capacity(
            plan.reuse.numel(), index.num_q_blocks, index.indices.numel(), chunk
        )
        want = _reference(plan, slots, chunk, num_items=items, num_parts=parts)
    got = triton_kv_schedule(plan.reuse, plan.kv_indptr, slots, chunk, num_items=items, num_parts=parts)
    for name in ("item_row", "item_t0", "item_t1", "item_part", "part_start", "num_parts"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
        assert getattr(got, name).dtype == torch.int32, name
    assert got.total_parts == want.total_parts
    if r0 > 1:
        assert (slots >= 0).any(), "the case must have cold blocks (no items of their own)"
    assert (got.item_part >= 0).any() or chunk >= index.num_q_blocks, "the case must cut rows into chunks"


def test_kv_schedule_kernel_of_an_empty_batch():
    empty = st.BlockIndex.from_selection(
        torch.zeros(0, 2, 3, 1, dtype=torch.int64, device=DEV),
        seq_len=96,
        block_q=32,
        block_k=32,
        capacity=2,
        check="none",
    )
    plan = empty.plan()
    slots = plan_mod.cold_slots(plan.hot, plan.reuse, False)
    got = triton_kv_schedule(plan.reuse, plan.kv_indptr, slots, 2, num_items=3, num_parts=0)
    want = _reference(plan, slots, 2, num_items=3, num_parts=0)
    assert got.item_row.tolist() == want.item_row.tolist() == [-1, -1, -1]
    assert got.item_t0.tolist() == want.item_t0.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda r, p, s: triton_kv_schedule(r, p[:-1], s, 2, num_items=4, num_parts=0),
            r"kv_indptr must be \[R \+ 1\]",
        ),
        (lambda r, p, s: triton_kv_schedule(r, p, s[:-1], 2, num_items=4, num_parts=0), r"slots \[R\]"),
        (lambda r, p, s: triton_kv_schedule(r, p, s, 0, num_items=4, num_parts=0), "chunk must be a positive int"),
        (lambda r, p, s: triton_kv_schedule(r, p, s, 2, num_items=-1, num_parts=0), "must be >= 0"),
    ],
    ids=["indptr-length", "slots-length", "chunk-0", "negative-items"],
)
def test_kv_schedule_kernel_rejects_bad_arguments(call, match):
    reuse = torch.tensor([2, 0, 3])
    indptr = torch.tensor([0, 2, 2, 5])
    slots = torch.full((3,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        call(reuse, indptr, slots)


@pytest.mark.gpu
def test_backward_takes_the_schedule_kernel_on_gpu(monkeypatch):
    """The attention backward on CUDA builds its work list with the kernel (and its gradients are those of the
    reference path, which the backward kernel tests check at length)."""
    import sparse_train.kernels.triton.schedule as schedule_module

    calls = []
    real_launch = schedule_module.kv_schedule_launch
    monkeypatch.setattr(schedule_module, "kv_schedule_launch", lambda *a: calls.append(1) or real_launch(*a))
    index, _ = _plan(1, 2, 4096, 64, 4, 2, 1, 1, seed=3)
    q = torch.randn(1, 4, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = st.sparse_attention(q, k, v, index, backend="triton")
    got = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref = torch.autograd.grad(st.sparse_attention(q, k, v, index, backend="reference").float().sum(), (q, k, v))
    assert calls, "the backward did not take the schedule kernel"
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), atol=5e-2, rtol=5e-2)
