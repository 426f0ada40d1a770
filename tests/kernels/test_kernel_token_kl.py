"""The token-level distillation kernels (kernels/triton/token_kl.py) against their PyTorch reference
(kernels/reference/token_kl.py) in float64, by the error-ratio rule: the per-row KL and the gradients of u, w and the
temperature; GQA 1 / 3 / 4, index heads 1-3, S padded to 16, odd lengths, listed blocks unsorted with the partial
last one, seq_lens with NaN padding and an empty row, packed documents, one key span and several, float16;
validation; the custom ops ``sparse_train::token_kl_fwd`` / ``sparse_train::token_kl_bwd`` (opcheck, the public function
compiled fullgraph, forward and backward, against eager); compiled for sm_90a. GPU-marked: bf16 at 16K (eight key
spans) against the float64 reference."""

import pytest
import torch
from builders import (
    check_close,
    compile_report_in_subprocess,
    compiled_fullgraph,
    ids_from_lengths,
    ptxas_path,
    ptxas_usage,
)

from sparse_train.kernels.reference.token_kl import reference_token_kl, token_kl_rows
from sparse_train.kernels.triton import token_kl as token_kl_kernels
from sparse_train.kernels.triton.token_kl import token_kl

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poison_fresh_outputs")  # fresh outputs start as NaN


def _inputs(B, H, G, N, D, E, S, BQ, blocks, lengths, *, dtype=torch.float32, device=DEV, seed=0):
    """(u, w, q_rows, k, temperature, query_blocks, seq_lens). The attention's q and k hold NaN past ``lengths``; the
    index vectors there are 0, as the indexer's inputs are."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, N, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g)
    w = torch.randn(B, H, N, S, generator=g) / S**0.25
    blocks_t = torch.tensor(blocks, dtype=torch.int64)
    rows = (blocks_t.view(-1, 1) * BQ + torch.arange(BQ)).reshape(-1).clamp(max=N - 1)
    u = torch.randn(B, H, len(rows), E, S, generator=g) / S**0.25
    temperature = torch.rand(H, generator=g) + 0.5
    lens = None
    if lengths is not None:
        lens = torch.tensor(lengths)
        pad = torch.arange(N).view(1, 1, N, 1) >= lens.view(B, 1, 1, 1)
        q, k = q.masked_fill(pad, float("nan")), k.masked_fill(pad, float("nan"))
        w = w.masked_fill(pad, 0.0)
        u = u.masked_fill((rows.view(1, 1, -1, 1, 1) >= lens.view(B, 1, 1, 1, 1)), 0.0)
        lens = lens.to(device)
    q_rows = q[:, :, rows]
    tensors = [t.to(device, dtype) for t in (u, w, q_rows, k)]
    return (*tensors, temperature.to(device), blocks_t.to(device), lens)


CASES = [
    # (B, H, G, N, D, E, S, BQ, listed blocks, lengths, document lengths per row)
    pytest.param(2, 2, 4, 147, 32, 1, 16, 16, (4, 1, 9), None, None, id="gqa4-odd-n-partial-last"),
    pytest.param(2, 1, 3, 100, 16, 2, 8, 16, (6, 0, 3), (100, 41), None, id="gqa3-e2-s8-nan-padding"),
    pytest.param(2, 2, 1, 90, 32, 3, 16, 32, (2, 0), (90, 0), None, id="mha-e3-empty-row"),
    pytest.param(2, 2, 2, 131, 16, 1, 16, 16, (8, 2, 5), (131, 120), ((40, 31, 60), (70, 61)), id="documents"),
    pytest.param(1, 2, 2, 70, 64, 2, 32, 32, (2, 1), None, None, id="d64-s32-bq32"),
]


def _both(u, w, q_rows, k, temperature, blocks, lens, docs, BQ, grad_seed=1):
    """(kl, du, dw, dtemp) from token_kl and from the reference in float64, and the reference in the inputs' dtype."""
    grad = torch.rand(u.shape[0], u.shape[1], u.shape[2], generator=torch.Generator().manual_seed(grad_seed))
    out = []
    for fn, dtype in ((token_kl, None), (reference_token_kl, torch.float64), (reference_token_kl, None)):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (u, w, temperature)]
        kl = fn(*leaves[:2], q_rows.to(dtype or q_rows.dtype), k.to(dtype or k.dtype), leaves[2], blocks,
                block_q=BQ, scale=0.3, seq_lens=lens, document_ids=docs)  # fmt: skip
        kl.backward(grad.to(kl.device, kl.dtype))
        out.append((kl.detach(), *(leaf.grad for leaf in leaves)))
    return out


@pytest.mark.parametrize("span", [token_kl_kernels.SPAN, 32], ids=["one-span", "spans-of-32"])
@pytest.mark.parametrize("B,H,G,N,D,E,S,BQ,blocks,lengths,docs", CASES)
def test_token_kl_matches_reference(B, H, G, N, D, E, S, BQ, blocks, lengths, docs, span, monkeypatch):
    """Against the float64 reference; with spans of 32 keys every row's keys split over several programs, whose
    partial sums the launchers combine."""
    monkeypatch.setattr(token_kl_kernels, "SPAN", span)
    u, w, q_rows, k, temperature, blocks_t, lens = _inputs(B, H, G, N, D, E, S, BQ, blocks, lengths, seed=N + E)
    doc_ids = None if docs is None else ids_from_lengths(*docs).to(DEV)
    got, ref, low = _both(u, w, q_rows, k, temperature, blocks_t, lens, doc_ids, BQ)
    rows = token_kl_rows(blocks_t, BQ, N, lens, B)  # [B, M]
    assert got[0].shape == (B, H, len(blocks) * BQ) and got[0].dtype == torch.float32
    assert torch.isfinite(got[0]).all() and all(torch.isfinite(g).all() for g in got[1:])
    assert torch.all(got[0][~rows.unsqueeze(1).expand_as(got[0])] == 0), "a row without keys has a loss"
    assert (ref[0] > 0).any()
    for name, a, b, c in zip(("kl", "du", "dw", "dtemperature"), got, ref, low):
        check_close(f"token kl {name}", a, b, c, torch.float32)


def test_token_kl_float16():
    """float16 inputs (bf16 only on the GPU), against the reference on the float16 values in float32."""
    u, w, q_rows, k, temperature, blocks, lens = _inputs(
        1, 2, 2, 100, 32, 1, 16, 16, (5, 2), (100,), dtype=torch.float16, seed=4
    )
    got, ref, _ = _both(u, w, q_rows, k, temperature, blocks, lens, None, 16)
    low = [reference_token_kl(u.float(), w.float(), q_rows.float(), k.float(), temperature, blocks, block_q=16,
                              scale=0.3, seq_lens=lens)]  # fmt: skip
    check_close("token kl fp16", got[0], ref[0], low[0], torch.float16)
    assert got[1].dtype == torch.float16 and torch.isfinite(got[1]).all()


def test_token_kl_empty_batch_and_no_listed_blocks():
    for B, blocks in ((0, (1, 2)), (1, ())):
        u, w, q_rows, k, temperature, blocks_t, _ = _inputs(B, 2, 2, 64, 16, 1, 16, 16, blocks, None, seed=2)
        u.requires_grad_()
        kl = token_kl(u, w, q_rows, k, temperature, blocks_t.to(torch.int64), block_q=16, scale=0.3)
        assert kl.shape == (B, 2, len(blocks) * 16)
        kl.sum().backward()
        assert u.grad.shape == u.shape


def test_token_kl_reuses_its_forward_statistics(monkeypatch):
    """A recompute of the same call (activation checkpointing) passes back the first call's statistics: the same KL
    and gradients, and neither forward kernel runs."""
    u, w, q_rows, k, temperature, blocks, lens = _inputs(2, 2, 2, 131, 16, 2, 16, 16, (8, 0, 5), (131, 90), seed=3)
    grad = torch.rand(2, 2, 48, generator=torch.Generator().manual_seed(3)).to(DEV)
    results = []
    for reuse in (None, "stats"):
        leaves = [t.detach().clone().requires_grad_() for t in (u, w, temperature)]
        kl, stats = token_kl(*leaves[:2], q_rows, k, leaves[2], blocks, block_q=16, scale=0.3, seq_lens=lens,
                             stats=results[0][1] if reuse else None, with_stats=True)  # fmt: skip
        kl.backward(grad)
        results.append((kl.detach(), stats, *(leaf.grad for leaf in leaves)))

        def refuse(*args):
            raise AssertionError("the forward kernels ran again")

        monkeypatch.setattr(token_kl_kernels, "token_kl_forward_launch", refuse)
    (first, stats, *first_grads), (again, again_stats, *again_grads) = results
    assert isinstance(stats, token_kl_kernels.TokenKLStats) and torch.equal(stats.kl, first)
    assert torch.equal(again, first) and torch.equal(again_stats.lse_s, stats.lse_s)
    for a, b in zip(again_grads, first_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the backward's atomics may add in another order


def test_token_kl_rejects_statistics_of_other_shapes():
    u, w, q_rows, k, temperature, blocks, _ = _inputs(1, 2, 2, 64, 16, 1, 16, 16, (1, 2), None, seed=5)
    _, stats = token_kl(u, w, q_rows, k, temperature, blocks, block_q=16, scale=0.3, with_stats=True)
    with pytest.raises(ValueError, match="stats must be"):
        token_kl(u[:, :, :16], w, q_rows[:, :, :16], k, temperature, blocks[:1], block_q=16, scale=0.3, stats=stats)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "u": a["u"][..., :1, :, :]}, "M = R \\* block_q"),
        (lambda a: {**a, "w": a["w"][:, :, :10]}, "u must be \\[B, H, M, E, S\\]"),
        (lambda a: {**a, "q_rows": a["q_rows"][:, :3]}, "q_rows must be"),
        (lambda a: {**a, "block_q": 24}, "block_q must be"),
        (lambda a: {**a, "w": a["w"].half()}, "share a dtype"),
        (lambda a: {**a, "temperature": a["temperature"][:1]}, "temperature must be"),
    ],
    ids=["rows", "w-length", "q-heads", "block-size", "dtypes", "temperature"],
)
def test_token_kl_rejects_bad_arguments(change, match):
    u, w, q_rows, k, temperature, blocks, _ = _inputs(1, 2, 2, 64, 16, 1, 16, 16, (1, 2), None, device="cpu")
    args = dict(u=u, w=w, q_rows=q_rows, k=k, temperature=temperature, query_blocks=blocks, block_q=16, scale=0.3)
    with pytest.raises(ValueError, match=match):
        token_kl(**change(args))


# ---------------------------------------------------------------------------------------------- custom ops
OP_CASES = [
    # (B, H, G, N, D, E, S, BQ, listed blocks, lengths, document lengths per row)
    pytest.param(2, 2, 3, 53, 16, 2, 8, 16, (3, 0), (53, 30), None, id="gqa3-e2-s8-lengths-partial-last"),
    pytest.param(1, 1, 2, 40, 16, 1, 16, 16, (2, 1), None, ((15, 25),), id="gqa2-documents"),
]


def _op_inputs(B, H, G, N, D, E, S, BQ, blocks, lengths, docs):
    """(u, w, q_rows, k, temperature, query_blocks int32, seq_lens int32, document_ids int32): the op's inputs as the
    public function passes them."""
    u, w, q_rows, k, temperature, blocks_t, lens = _inputs(B, H, G, N, D, E, S, BQ, blocks, lengths, seed=N + G)
    ids = None if docs is None else ids_from_lengths(*docs).to(DEV, torch.int32)
    lens = None if lens is None else lens.to(torch.int32)
    return u, w, q_rows, k, temperature, blocks_t.to(torch.int32), lens, ids


@pytest.mark.parametrize("with_stats", [False, True], ids=["kernels", "stats"])
@pytest.mark.parametrize("B,H,G,N,D,E,S,BQ,blocks,lengths,docs", OP_CASES)
def test_token_kl_ops_pass_opcheck(B, H, G, N, D, E, S, BQ, blocks, lengths, docs, with_stats):
    """The forward op's schema, fake (shapes, dtypes, strides), autograd registration and AOT dispatch (gradients of u,
    w and the temperature through the backward op), with the forward kernels or an earlier call's statistics; the
    backward op's likewise."""
    u, w, q_rows, k, temperature, blocks_t, lens, ids = _op_inputs(B, H, G, N, D, E, S, BQ, blocks, lengths, docs)
    args = (u, w, temperature, q_rows, k, blocks_t, BQ, 0.3, lens, ids)
    stats = list(torch.ops.sparse_train.token_kl_fwd(*args, [])) if with_stats else []
    leaves = [t.clone().requires_grad_() for t in (u, w, temperature)]
    torch.library.opcheck(torch.ops.sparse_train.token_kl_fwd.default, (*leaves, *args[3:], stats))
    if not with_stats:
        _, lse_s, lse_z, mass = torch.ops.sparse_train.token_kl_fwd(*args, [])
        grad = torch.rand(lse_z.shape, generator=torch.Generator().manual_seed(4)).to(DEV)
        torch.library.opcheck(
            torch.ops.sparse_train.token_kl_bwd.default,
            (grad, u, w, temperature, q_rows, k, blocks_t, BQ, 0.3, lens, ids, lse_s, lse_z, mass),
        )


@pytest.mark.parametrize("B,H,G,N,D,E,S,BQ,blocks,lengths,docs", OP_CASES)
def test_token_kl_compiled_fullgraph_equals_eager(B, H, G, N, D, E, S, BQ, blocks, lengths, docs):
    """The public function compiled with fullgraph runs the kernels through the ops: the eager KL and statistics bit
    for bit, the gradients of u, w and the temperature up to the order of the backward's atomics."""
    u, w, q_rows, k, temperature, blocks_t, lens = _inputs(B, H, G, N, D, E, S, BQ, blocks, lengths, seed=N + G)
    ids = None if docs is None else ids_from_lengths(*docs).to(DEV)
    grad = torch.rand(B, H, len(blocks) * BQ, generator=torch.Generator().manual_seed(6)).to(DEV)

    def loss(u, w, temperature):
        kl, stats = token_kl(u, w, q_rows, k, temperature, blocks_t, block_q=BQ, scale=0.3, seq_lens=lens,
                             document_ids=ids, with_stats=True)  # fmt: skip
        return kl, stats, (kl * grad).sum()

    results = []
    for call in (loss, compiled_fullgraph(loss)):
        leaves = [t.detach().clone().requires_grad_() for t in (u, w, temperature)]
        kl, stats, total = call(*leaves)
        total.backward()
        results.append((kl, stats, [leaf.grad for leaf in leaves]))
    (want, want_stats, want_grads), (got, got_stats, got_grads) = results
    assert torch.equal(got, want)
    for a, b in zip(got_stats, want_stats):
        assert torch.equal(a, b)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------- compile for Hopper
HOPPER_SHARED_BYTES = 232448
"""The most shared memory one block of an sm_90 GPU (H100, H200) may use: 227 KiB."""


def hopper_compile_report(cases):
    """[(kernel, registers, spill store bytes, shared memory bytes)] of the three kernels compiled for sm_90a for each
    ``(G, E, D)`` case (bf16, BQ = 64, S = 32, lengths and documents), each at its launcher's pipeline stages. Runs in
    a process without the interpreter."""
    import triton
    from builders import warmup_for_hopper

    from sparse_train.kernels.triton import token_kl as kernels

    report = []
    for G, E, D in cases:
        B, H, N, M, S = 1, 2, 256, 64, 32
        u = torch.zeros(B, H, M, E, S, dtype=torch.bfloat16)
        w = torch.zeros(B, H, N, S, dtype=torch.bfloat16)
        q = torch.zeros(B, H * G, M, D, dtype=torch.bfloat16)
        k = torch.zeros(B, H, N, D, dtype=torch.bfloat16)
        f32, ints = torch.zeros(4), torch.zeros(4, dtype=torch.int32)
        meta = dict(GROUP=G, E=E, BLOCK_Q=64, KEYS=kernels.KEYS, SPAN=kernels.SPAN, HEAD_DIM=D,
                    D_P2=triton.next_power_of_2(D), S_P2=S, HAS_SEQ_LENS=True, HAS_DOCS=True, IEEE=False,
                    num_warps=kernels.NUM_WARPS, grid=(1, 1, 1))  # fmt: skip
        head = (u, w, q, k, f32, ints, ints, ints)
        strides = (*u.stride(), *w.stride(), *q.stride(), *k.stride(), H, N, M, S, 0.1)
        compiled = {
            "lse": warmup_for_hopper(
                kernels._token_kl_lse_kernel, *head, f32, f32, *strides, num_stages=kernels.LSE_STAGES, **meta
            ),
            "moments": warmup_for_hopper(
                kernels._token_kl_moments_kernel, *head, f32, f32, *strides, num_stages=kernels.MOMENTS_STAGES, **meta
            ),
            "backward": warmup_for_hopper(
                kernels._token_kl_backward_kernel,
                *head,
                f32,
                f32,
                f32,
                f32,
                f32,
                f32,
                f32,
                *strides,
                num_stages=kernels.BACKWARD_STAGES,
                **meta,
            ),  # fmt: skip
        }
        report += [(name, *ptxas_usage(c), c.metadata.shared) for name, c in compiled.items()]
    return report


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
def test_kernels_compile_for_hopper():
    """The interpreter accepts programs the compiler rejects (a bf16 operand next to an fp32 one), and knows no shared
    memory limit: the three kernels compile for sm_90a at their pipeline stages with lengths and documents for GQA
    1 / 4 / 8, E 1 / 2, D 64 / 128, within sm_90's shared memory, and without register spills for one index head
    (the default) up to GQA 4. The backward, which recomputes every head's product for each index head's walk,
    spills with more index heads; at GQA 8 the second pass and the backward sit at the 255-register limit and may
    spill a few bytes."""
    if ptxas_path() is None:
        pytest.skip("this triton ships no ptxas")
    cases = [(4, 1, 128), (8, 1, 128), (1, 2, 64), (4, 2, 128)]
    report = compile_report_in_subprocess(__file__, "hopper_compile_report", cases)
    assert len(report) == 3 * len(cases)
    for index, (name, registers, spills, shared) in enumerate(report):
        G, E, D = cases[index // 3]
        print(f"G={G} E={E} D={D} {name}: {registers} registers, {spills} bytes spilled, {shared} bytes shared")
        assert shared <= HOPPER_SHARED_BYTES, (G, E, D, name, shared)
        assert spills == 0 or E > 1 or (G >= 8 and name != "lse"), (G, E, D, name)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_bf16_16k():
    """bf16, N = 16384, B = 1, H = 2, G = 4, D = 128, E = 1, S = 32, BQ = 64, 4 listed blocks (the first, the last,
    two inside), packed documents: the KL and the gradients against the float64 reference."""
    N, BQ = 16384, 64
    blocks = (255, 0, 100, 170)
    u, w, q_rows, k, temperature, blocks_t, _ = _inputs(
        1, 2, 4, N, 128, 1, 32, BQ, blocks, None, dtype=torch.bfloat16, device="cuda", seed=16
    )
    docs = ids_from_lengths((5000, 7000, N - 12000)).cuda()
    got, ref, low = _both(u, w, q_rows, k, temperature, blocks_t, None, docs, BQ)
    for name, a, b, c in zip(("kl", "du", "dw", "dtemperature"), got, ref, low):
        check_close(f"token kl bf16 16K {name}", a.float(), b, c.float(), torch.bfloat16)
