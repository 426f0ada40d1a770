"""The query-block map of the Triton kernels (context parallelism, phase 2): ``sparse_attention(...,
query_blocks=)`` on the Triton backend against the PyTorch reference with the same map (fp64, the error-ratio
rule of builders.check_close; CPU: Triton interpreter, fp32) and against the rows of the full single-process
op; the argument checks of both backends. GPU (marker ``gpu``): bf16/fp16 at a real size against the fp64
reference, and, with two CUDA devices, ``context_parallel_sparse_attention(backend="triton")`` on two NCCL
processes against the single-GPU op.
"""

import os

import pytest
import torch
from builders import check_close, ids_from_starts, make_qkv, random_index, random_selection, rel_err, spawn_ranks

from sparse_train.functional import sparse_attention
from sparse_train.index.block_index import BlockIndex
from sparse_train.kernels.reference.attention import reference_sparse_attention
from sparse_train.plan import plan as plan_mod

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

import sparse_train.parallel.context_parallel as cp  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DLSE_W = 0.3  # weight of lse in the loss: the lse gradient path (delta - dlse) runs too

pytestmark = pytest.mark.usefixtures("poison_fresh_outputs", "small_kv_chunks")  # conftest.py


def _zigzag(world):
    return lambda n, bq: [cp.local_query_blocks(n, bq, r, world) for r in range(world)]


def _listed(*lists):
    return lambda n, bq: [torch.tensor(blocks) for blocks in lists]


def _rows(blocks, n, bq):
    """Global positions of the rows of q under ``blocks`` (listed order; the last block may be short)."""
    return torch.cat([torch.arange(bq * b, min(bq * b + bq, n)) for b in blocks.tolist()])


CASES = [
    # B, HQ, HKV, N, D, BQ, BK, blocks (n, bq) -> list of maps, extras
    pytest.param(1, 4, 2, 128, 16, 16, 16, _zigzag(2), {}, id="zigzag-w2-gqa"),
    pytest.param(
        2, 2, 1, 96, 16, 16, 16, _zigzag(3), {"seq_lens": [96, 40]}, id="zigzag-w3-seq_lens-ending-inside-a-local-chunk"
    ),
    pytest.param(
        1,
        4,
        2,
        75,
        16,
        16,
        16,
        _listed([4, 0, 2], [3, 1]),
        {"dropout_p": 0.2},
        id="unsorted-subsets-short-last-block-first-dropout",
    ),
    pytest.param(
        2,
        4,
        2,
        64,
        16,
        16,
        16,
        _zigzag(2),
        {"documents": [[0, 5, 21, 40], [0, 33]], "dropout_p": 0.3},
        id="zigzag-w2-documents-dropout",
    ),
    pytest.param(
        1, 4, 2, 128, 16, 16, 16, _zigzag(2), {"r0": 3, "hot_and_cold": True}, id="zigzag-w2-hybrid-hot-and-cold-r0_3"
    ),
    pytest.param(
        1,
        2,
        1,
        128,
        16,
        32,
        16,
        _zigzag(2),
        {"deterministic": True, "seq_lens": [101]},
        id="zigzag-w2-deterministic-bq32-bk16",
    ),
    pytest.param(
        1,
        2,
        2,
        120,
        32,
        16,
        32,
        _listed([7, 2, 5], [0, 6, 1, 3, 4]),
        {"r0": 2, "num_splits": 2},
        id="partition-odd120-bq16-bk32-split2-hybrid",
    ),
    pytest.param(
        2,
        4,
        2,
        75,
        16,
        16,
        16,
        _listed([4, 0, 2], [3, 1]),
        {"documents": [[0, 5, 21, 40], [0, 33]], "dropout_p": 0.2, "fused_dq": True},
        id="unsorted-short-last-block-documents-dropout-fused-dq",
    ),
    pytest.param(
        2,
        4,
        2,
        75,
        16,
        16,
        16,
        _listed([4, 0, 2], [3, 1]),
        {"documents": [[0, 5, 21, 40], [0, 33]], "dropout_p": 0.2, "stored_ds": True, "seq_lens": [75, 50]},
        id="unsorted-short-last-block-documents-dropout-seq_lens-stored-ds",
    ),
]


def _grads(fn, q, k, v, do):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(qs, ks, vs)
    loss = (o * do).sum() + DLSE_W * torch.where(torch.isfinite(lse), lse, 0).sum()
    return (o.detach(), lse.detach(), *torch.autograd.grad(loss, (qs, ks, vs)))


NAMES = ("o", "lse", "dq", "dk", "dv")


def _kernel_and_references(index, blocks, q_sub, k, v, do_sub, kernel: dict, common: dict):
    """``(got, want, lowp)``: o, lse, dq, dk, dv of the kernels with ``query_blocks=blocks``, of the fp64
    reference, and of the reference in the inputs' precision (the error-ratio rule's baseline)."""
    got = _grads(lambda a, b, c: sparse_attention(a, b, c, index, query_blocks=blocks, **kernel), q_sub, k, v, do_sub)
    ref_kw = dict(common, query_blocks=blocks)
    want = _grads(
        lambda a, b, c: reference_sparse_attention(a, b, c, index, **ref_kw),
        q_sub.double(),
        k.double(),
        v.double(),
        do_sub.double(),
    )
    lowp = _grads(
        lambda a, b, c: reference_sparse_attention(a, b, c, index, upcast=False, **ref_kw), q_sub, k, v, do_sub
    )
    return got, want, lowp


@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,maps,extras", CASES)
def test_triton_query_blocks_match_the_reference_and_the_full_op(B, HQ, HKV, N, D, BQ, BK, maps, extras):
    """For each query-block map: o, lse, dq, dk, dv of the kernels against the fp64 reference with the same
    map (error-ratio rule), and the maps together against the full single-process kernels: the rows of o,
    lse and dq, dK/dV summed over the maps (when they partition the blocks), the dropout bits (o with
    dropout is the full op's rows, and differs from o without)."""
    docs = ids_from_starts(extras["documents"], N).to(DEV) if "documents" in extras else None
    if docs is None:
        index = random_index(B, HKV, N, BQ, BK, 2, 1, 1, seed=N + BQ, device=DEV)
    else:
        index = BlockIndex.from_selection(
            random_selection(B, HKV, N, BQ, BK, 2, seed=3).to(DEV),
            seq_len=N,
            block_q=BQ,
            block_k=BK,
            window=1,
            sinks=1,
            document_ids=docs,
        )
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.float32, seed=N, device=DEV)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q)
    seq_lens = torch.tensor(extras["seq_lens"], device=DEV) if "seq_lens" in extras else None
    p = extras.get("dropout_p", 0.0)
    options = {
        "r0": extras.get("r0", 1),
        "num_splits": extras.get("num_splits"),
        "fused_dq": extras.get("fused_dq"),
        "stored_ds": extras.get("stored_ds"),
    }
    common = dict(seq_lens=seq_lens, document_ids=docs, dropout_p=p, dropout_seed=123 if p else None)
    kernel = dict(
        common,
        backend="triton",
        return_lse=True,
        kernel_options=options,
        deterministic=extras.get("deterministic", False),
    )

    full = _grads(lambda a, b, c: sparse_attention(a, b, c, index, **kernel), q, k, v, do)
    nqb = index.num_q_blocks
    maps = [m.to(DEV) for m in maps(N, BQ)]
    partition = sorted(torch.cat(maps).tolist()) == list(range(nqb))
    dk_sum, dv_sum = torch.zeros_like(k), torch.zeros_like(v)
    for blocks in maps:
        rows = _rows(blocks.cpu(), N, BQ).to(DEV)
        if extras.get("hot_and_cold"):
            local_plan = plan_mod.build_plan(index, options["r0"], query_blocks=blocks)
            assert local_plan.num_hot > 0 and local_plan.num_cold > 0, "both dK/dV paths must run"
        q_sub, do_sub = q[:, :, rows], do[:, :, rows]
        got, want, lowp = _kernel_and_references(index, blocks, q_sub, k, v, do_sub, kernel, common)
        for name, a, r, l in zip(NAMES, got, want, lowp):
            assert not torch.isnan(a).any(), f"{name} has NaN (unwritten or 0/0)"
            check_close(name, a, r, l, torch.float32)
        for name, a, f in zip(NAMES[:3], got[:3], full[:3]):  # the full op's rows, dropout bits included
            torch.testing.assert_close(a, f[:, :, rows], msg=f"{name}: not the full op's rows")
        dk_sum += got[3]
        dv_sum += got[4]
        if extras.get("deterministic"):
            again = _grads(
                lambda a, b, c: sparse_attention(a, b, c, index, query_blocks=blocks, **kernel), q_sub, k, v, do_sub
            )
            for name, a, b in zip(NAMES, got, again):
                assert torch.equal(a, b), f"{name}: deterministic mode must be bitwise reproducible"
        if p:
            plain = sparse_attention(
                q_sub, k, v, index, query_blocks=blocks, backend="triton", seq_lens=seq_lens, document_ids=docs
            )
            assert rel_err(plain, got[0]) > 1e-2, "dropout must change o (the bits are not all kept)"
    if partition:  # the ranks' dK/dV partials sum to the full op's (the reduce-scatter of CP)
        torch.testing.assert_close(dk_sum, full[3])
        torch.testing.assert_close(dv_sum, full[4])


def test_kernels_without_a_map_are_the_plain_launch(monkeypatch):
    """No query_blocks: the launchers get no map (HAS_QUERY_MAP False: the kernels compile as before)."""
    from sparse_train.kernels.triton import op as kop

    seen = []
    real_fwd, real_bwd = kop.sparse_attn_forward, kop.sparse_attn_backward

    def fwd(*args, **kw):
        seen.append(("fwd", kw["query_map"]))
        return real_fwd(*args, **kw)

    def bwd(*args, **kw):
        seen.append(("bwd", kw["query_map"]))
        return real_bwd(*args, **kw)

    monkeypatch.setattr(kop, "sparse_attn_forward", fwd)
    monkeypatch.setattr(kop, "sparse_attn_backward", bwd)
    index = random_index(1, 1, 64, 16, 16, 2, 1, 1, seed=1)
    q, k, v = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=1, requires_grad=True)
    sparse_attention(q, k, v, index, backend="triton").sum().backward()
    blocks = torch.tensor([2, 0])
    q2 = q.detach()[:, :, torch.cat([torch.arange(32, 48), torch.arange(0, 16)])].requires_grad_()
    sparse_attention(q2, k, v, index, backend="triton", query_blocks=blocks).sum().backward()
    assert [s for s, _ in seen] == ["fwd", "bwd", "fwd", "bwd"]
    assert seen[0][1] is None and seen[1][1] is None
    assert torch.equal(seen[2][1].cpu(), blocks.to(torch.int32)) and torch.equal(seen[3][1].cpu(), seen[2][1].cpu())


def _bad_calls(q, k, v, index):
    """(call, the words its ValueError must contain) for a 64-token index of 16-blocks (NQB = 4)."""
    rows = q[:, :, :32]
    return [
        (dict(q=rows, query_blocks=torch.tensor([1, 1])), "query_blocks must be distinct"),
        (dict(q=rows, query_blocks=torch.tensor([0, 4])), "query_blocks must be a non-empty list of query-block ids"),
        (dict(q=rows, query_blocks=torch.tensor([-1, 2])), "query_blocks must be a non-empty list of query-block ids"),
        (dict(q=rows[:, :, :20], query_blocks=torch.tensor([0, 2])), "q must hold the 32 rows"),
        (dict(q=rows, query_blocks=torch.tensor([[0, 2]])), "query_blocks must be 1-D"),
        (dict(q=rows, query_blocks=torch.tensor([0.0, 2.0])), "query_blocks must have an integer dtype"),
        (dict(q=rows, query_blocks=torch.tensor([0, 2], device="meta")), "query_blocks is on meta"),
        (dict(q=rows, query_blocks=torch.zeros(0, dtype=torch.int64)), "query_blocks must list between 1 and NQB=4"),
        (
            dict(q=rows, query_blocks=torch.tensor([0, 2]), kernel_options={"plan": index.plan()}),
            "kernel_options.plan cannot be combined with query_blocks",
        ),
    ]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_query_blocks_raise_a_value_error_naming_them(backend):
    index = random_index(1, 1, 64, 16, 16, 2, 1, 1, seed=2)
    q, k, v = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=2)
    for call, words in _bad_calls(q, k, v, index):
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            sparse_attention(call.pop("q"), k, v, index, backend=backend, **call)


def test_unchecked_query_blocks_are_clamped_not_read_out_of_bounds():
    """check_values=False with N % BQ == 0: no host read of the ids; an out-of-range id is clamped into
    [0, NQB) on the device (the rows of the last block), so no kernel addresses memory outside its tensors."""
    index = random_index(1, 1, 64, 16, 16, 2, 1, 1, seed=3)
    q, k, v = make_qkv(1, 2, 1, 64, 16, torch.float32, seed=3)
    got = sparse_attention(
        q[:, :, :16], k, v, index, backend="triton", check_values=False, query_blocks=torch.tensor([9])
    )
    want = sparse_attention(q[:, :, :16], k, v, index, backend="triton", query_blocks=torch.tensor([3]))
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "B,HQ,HKV,N,D,BQ,BK,world,extras",
    [
        pytest.param(
            1, 8, 2, 8192, 128, 64, 64, 4, {"dropout_p": 0.1, "seq_lens": [7001]}, id="d128-b64-w4-dropout-seq_lens"
        ),
        pytest.param(2, 4, 4, 4096, 64, 128, 64, 2, {"r0": 4}, id="d64-bq128-bk64-w2-hybrid"),
        pytest.param(1, 8, 1, 6144, 64, 64, 128, 3, {"documents": True}, id="d64-bq64-bk128-w3-documents"),
    ],
)
def test_query_blocks_on_gpu(B, HQ, HKV, N, D, BQ, BK, world, extras, dtype):
    """Every rank's map of a zig-zag layout on the GPU: o, dq, dk, dv against the reference in fp64 with the
    same map (c = 3, floor 1e-4, as the GPU kernel tests), and the rows of the full single-GPU op."""
    index_kw = {}
    docs = None
    if extras.get("documents"):
        docs = torch.zeros(B, N, dtype=torch.int64, device="cuda")
        for start in (0, 1000, 1003, 2900, 5000):
            docs[:, start:] += 1
        index_kw["document_ids"] = docs
    sel = random_selection(B, HKV, N, BQ, BK, 6, seed=N).cuda()
    index = BlockIndex.from_selection(sel, seq_len=N, block_q=BQ, block_k=BK, window=2, sinks=1, **index_kw)
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, seed=N, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    seq_lens = torch.tensor(extras["seq_lens"], device="cuda") if "seq_lens" in extras else None
    p = extras.get("dropout_p", 0.0)
    common = dict(seq_lens=seq_lens, document_ids=docs, dropout_p=p, dropout_seed=77 if p else None)
    kernel = dict(common, backend="triton", return_lse=True, kernel_options={"r0": extras.get("r0", 1)})
    full = _grads(lambda a, b, c: sparse_attention(a, b, c, index, **kernel), q, k, v, do)
    for rank in range(world):
        blocks = cp.local_query_blocks(N, BQ, rank, world, device="cuda")
        rows = (blocks.view(-1, 1) * BQ + torch.arange(BQ, device="cuda")).view(-1)
        got, want, lowp = _kernel_and_references(index, blocks, q[:, :, rows], k, v, do[:, :, rows], kernel, common)
        for name, a, r, l in zip(NAMES, got, want, lowp):
            if name == "lse":
                continue  # fp32 in every computation: compared with the full op below
            check_close(f"rank {rank} {name}", a, r, l, dtype, c=3.0, floor=1e-4)
        for name, a, f in zip(NAMES[:3], got[:3], full[:3]):
            assert rel_err(a, f[:, :, rows]) < 1e-2, f"rank {rank} {name}: not the full op's rows"


def _nccl_worker(rank, port, out_dir, case):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    q, k, v, do, index, seq_lens, p = _nccl_inputs(case, f"cuda:{rank}")
    seed = cp.shared_dropout_seed() if p else None
    local = [cp.shard_sequence(t, 2, rank, 2).detach().requires_grad_() for t in (q, k, v)]
    o, lse = cp.context_parallel_sparse_attention(
        *local, index, dropout_p=p, dropout_seed=seed, seq_lens=seq_lens, backend="triton", return_lse=True
    )
    (o.float() * cp.shard_sequence(do, 2, rank, 2).float()).sum().backward()
    torch.save(
        dict(
            o=o.detach().cpu(),
            lse=lse.detach().cpu(),
            dq=local[0].grad.cpu(),
            dk=local[1].grad.cpu(),
            dv=local[2].grad.cpu(),
            seed=seed,
        ),
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()


def _nccl_inputs(case, device):
    B, HQ, HKV, N, D, BQ, BK, extras = case
    index = random_index(B, HKV, N, BQ, BK, 6, 2, 1, seed=9, device=device)
    q, k, v = make_qkv(B, HQ, HKV, N, D, torch.bfloat16, seed=9, device=device)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(q)
    seq_lens = torch.tensor(extras["seq_lens"], device=device) if "seq_lens" in extras else None
    return q, k, v, do, index, seq_lens, extras.get("dropout_p", 0.0)


NCCL_CASES = [
    pytest.param((1, 8, 2, 8192, 128, 64, 64, {"dropout_p": 0.1, "seq_lens": [6000]}), id="d128-b64-dropout-seq_lens"),
    pytest.param((2, 4, 4, 4096, 64, 128, 128, {}), id="d64-b128-mha"),
]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("case", NCCL_CASES)
def test_context_parallel_triton_on_two_gpus_equals_the_single_gpu_op(case, tmp_path):
    """context_parallel_sparse_attention(backend="triton") on two NCCL processes (bf16): each rank's o, lse,
    dq and the reduce-scattered dk, dv against its rows of the single-GPU op on the global tensors (the same
    kernels on the same rows; dK/dV add the two ranks' bf16 partials, so compared by relative error) and
    against the fp32 reference (the GPU kernel tests' error-ratio rule, c = 3)."""
    spawn_ranks(_nccl_worker, 2, str(tmp_path), case)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    seed = results[0]["seed"]
    assert seed == results[1]["seed"]
    q, k, v, do, index, seq_lens, p = _nccl_inputs(case, "cuda:0")
    kw = dict(seq_lens=seq_lens, dropout_p=p, dropout_seed=seed)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = sparse_attention(qs, ks, vs, index, backend="triton", return_lse=True, **kw)
    (o.float() * do.float()).sum().backward()
    full = dict(o=o.detach(), lse=lse.detach(), dq=qs.grad, dk=ks.grad, dv=vs.grad)
    ref, lowp = {}, {}
    for store, dtype, upcast in ((ref, torch.float32, True), (lowp, torch.bfloat16, False)):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        o_r, _ = reference_sparse_attention(qr, kr, vr, index, upcast=upcast, **kw)
        (o_r.float() * do.float()).sum().backward()
        store.update(o=o_r.detach(), dq=qr.grad, dk=kr.grad, dv=vr.grad)
    for rank, got in enumerate(results):
        for name, want in full.items():
            local = cp.shard_sequence(want, 2, rank, 2).cpu()
            assert got[name].shape == local.shape
            assert rel_err(got[name], local) < 1e-2, f"rank {rank} {name} vs the single-GPU op"
            if name in ref:
                check_close(
                    f"rank {rank} {name}",
                    got[name],
                    cp.shard_sequence(ref[name], 2, rank, 2).cpu(),
                    cp.shard_sequence(lowp[name], 2, rank, 2).cpu(),
                    torch.bfloat16,
                    c=3.0,
                    floor=1e-4,
                )
