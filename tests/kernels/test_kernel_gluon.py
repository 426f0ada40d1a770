"""The Gluon kernels: the forward (``kernel_options.fwd_gluon``, sparse_train/kernels/gluon/forward.py), the
KV-centric dK/dV (``kv_gluon``) and dQ (``dq_gluon``) of the backward (sparse_train/kernels/gluon/backward.py).

Gluon kernels do not run in Triton's interpreter. On the CPU: each kernel compiles for sm_90a (a Hopper target
set without a GPU; ptxas ships with triton) at the tiles ``plan.tuning.backward_config`` picks, without spilled
registers; the launcher runs the Triton kernels wherever the Gluon ones do not apply (here: no Hopper), with
bitwise the Triton kernels' gradients; the config fields and the reasons for a fallback. On the GPU (marker
``gpu``): o, dq, dk, dv against the fp32 reference at real sizes (c = 3, as tests/kernels/test_kernel_backward.py),
with chunked rows (partials), GQA and MHA, and the compiled kernels show that the Gluon kernels ran.
"""

import os

import pytest
import torch
from builders import make_qkv, ptxas_path, ptxas_usage, random_index, warmup_for_hopper

from sparse_train.kernels.gluon import backward as bg
from sparse_train.kernels.gluon import forward as fg
from sparse_train.plan.tuning import backward_config, forward_config

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from sparse_train.kernels.triton import backward as kb  # noqa: E402
from sparse_train.kernels.triton.op import triton_sparse_attention  # noqa: E402

pytestmark = pytest.mark.skipif(not bg.HAS_GLUON, reason="this triton has no Gluon")


def _ptxas_report(compiled) -> tuple[int, int]:
    """(registers, spill store bytes) of a kernel compiled for sm_90a, from the ptxas that ships with triton."""
    if ptxas_path() is None:
        pytest.skip("this triton ships no ptxas")
    return ptxas_usage(compiled)


class _CompileInputs:
    """Placeholder CPU tensors with the shapes, dtypes and strides a Gluon launch is specialised on (their values
    never matter: the kernels are only compiled): q-like ``[1, 2 * group, 4 * block, D]``, k-like
    ``[1, 2, 4 * block, D]``, per-row statistics, an index of 4 x 4 slots, document ids, work-item arrays and
    chunk partials."""

    def __init__(self, block: int, head_dim: int, group: int):
        n, hkv = 4 * block, 2
        self.q = torch.zeros(1, hkv * group, n, head_dim, dtype=torch.bfloat16)
        self.k = torch.zeros(1, hkv, n, head_dim, dtype=torch.bfloat16)
        self.stats = torch.zeros(1, hkv * group, n)
        self.indices = torch.zeros(1, hkv, 4, 4, dtype=torch.int32)
        self.counts = torch.zeros(1, hkv, 4, dtype=torch.int32)
        self.docs = torch.zeros(1, n, dtype=torch.int32)
        self.items = torch.zeros(8, dtype=torch.int32)
        self.partials = torch.zeros(2, block, head_dim)
        self.scale = head_dim**-0.5


COMPILE_CASES = [
    # block (BQ = BK), head dim, GQA group, key rows per program (None: backward_config's, 64), spilled bytes
    # allowed (ptxas of triton 3.6: a whole 128 x 128 key tile in one 8-warp program spills 32 bytes)
    pytest.param(64, 128, 4, None, 0, id="P64-d128-gqa4"),
    pytest.param(128, 128, 4, None, 0, id="P128-d128-gqa4-two-64-row-programs"),
    pytest.param(128, 128, 4, 128, 32, id="P128-d128-gqa4-one-128-row-program"),
    pytest.param(64, 64, 4, None, 0, id="P64-d64-gqa4"),
    pytest.param(128, 64, 1, None, 0, id="P128-d64-mha"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
@pytest.mark.parametrize("block,head_dim,group,key_rows,spill_bytes", COMPILE_CASES)
def test_gluon_kernel_compiles_for_hopper_without_spills(block, head_dim, group, key_rows, spill_bytes):
    """The KV-centric kernel at backward_config's Gluon tiles compiles to sm_90a and fits in registers (a spill
    would put the accumulators in local memory, as Nsight Compute shows for spilling Triton tiles), and in the
    shared memory of the programs per SM it was sized for: two 64-key-row programs, or one of 128 rows."""
    config = backward_config(group, block, block, head_dim, False, {"kv_gluon": True})
    key_rows = key_rows or config.gluon_key_rows
    x = _CompileInputs(block, head_dim, group)
    grid, args, kwargs = bg.dkdv_gluon_arguments(
        x.q,
        x.k,
        x.k,
        x.q,
        x.stats,
        x.stats,
        x.items,
        x.items,
        x.items,
        x.items,
        x.items,
        x.k,
        x.k,
        x.partials,
        x.partials,
        block_q=block,
        block_k=block,
        scale=x.scale,
        tile_rows=config.gluon_tile_rows,
        num_buf=config.gluon_stages,
        key_rows=key_rows,
    )
    assert kwargs["KEY_ROWS"] == min(block, key_rows) and grid == (x.items.numel() * block // kwargs["KEY_ROWS"],)
    compiled = warmup_for_hopper(bg._dkdv_gluon_kernel, *args, grid=grid, **kwargs)
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]  # the q/dO ring is filled by TMA
    registers, spills = _ptxas_report(compiled)
    print(
        f"block {block} D {head_dim}: {registers} registers, {spills} bytes spilled, "
        f"{compiled.metadata.shared} bytes of shared memory"
    )
    assert spills <= spill_bytes
    assert compiled.metadata.shared <= 228 * 1024 // (2 if kwargs["KEY_ROWS"] == 64 else 1)


DQ_COMPILE_CASES = [
    # block (BQ = BK), head dim, GQA group, heads per program (None: backward_config's, one head = BQ rows)
    pytest.param(64, 128, 4, None, id="P64-d128-gqa4"),
    pytest.param(128, 128, 4, None, id="P128-d128-gqa4"),
    pytest.param(64, 64, 4, None, id="P64-d64-gqa4"),
    pytest.param(128, 64, 1, None, id="P128-d64-mha"),
    pytest.param(64, 128, 4, 2, id="P64-d128-gqa4-two-heads-128-rows"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
@pytest.mark.parametrize("block,head_dim,group,heads", DQ_COMPILE_CASES)
def test_gluon_dq_kernel_compiles_for_hopper_without_spills(block, head_dim, group, heads):
    """The dQ kernel at backward_config's tiles (and 128 rows of two heads) compiles to sm_90a, K/V by TMA, and
    fits in registers with its K/V ring in one program's shared memory."""
    config = backward_config(group, block, block, head_dim, False, {"dq_gluon": True, "dq_heads_per_program": heads})
    x = _CompileInputs(block, head_dim, group)
    grid, args, kwargs = bg.dq_gluon_arguments(
        x.q,
        x.k,
        x.k,
        x.q,
        x.stats,
        x.stats,
        x.indices,
        x.counts,
        x.q,
        block_q=block,
        block_k=block,
        scale=x.scale,
        heads_per_program=config.dq_gluon_heads_per_program,
        num_buf=config.dq_gluon_stages,
    )
    compiled = warmup_for_hopper(bg._dq_gluon_kernel, *args, grid=grid, **kwargs)
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]  # the K/V ring is filled by TMA
    registers, spills = _ptxas_report(compiled)
    print(
        f"dQ block {block} D {head_dim}: {registers} registers, {spills} bytes spilled, "
        f"{compiled.metadata.shared} bytes of shared memory"
    )
    assert spills == 0
    assert compiled.metadata.shared <= 227 * 1024


FWD_COMPILE_CASES = [
    # block (BQ = BK), head dim, GQA group, heads per program (None: forward_config's Gluon tile, BQ rows)
    pytest.param(64, 128, 4, None, id="P64-d128-gqa4"),
    pytest.param(128, 128, 4, None, id="P128-d128-gqa4"),
    pytest.param(64, 64, 4, None, id="P64-d64-gqa4"),
    pytest.param(128, 64, 1, None, id="P128-d64-mha"),
    pytest.param(64, 128, 4, 4, id="P64-d128-gqa4-256-rows"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
@pytest.mark.parametrize("block,head_dim,group,heads", FWD_COMPILE_CASES)
def test_gluon_forward_compiles_for_hopper_without_spills(block, head_dim, group, heads):
    """The forward at forward_config's Gluon tiles (and 256 rows of four heads) compiles to sm_90a, K/V by TMA,
    within registers and one program's shared memory."""
    config = forward_config(group, block, block, head_dim, {"fwd_gluon": True})
    x = _CompileInputs(block, head_dim, group)
    grid, args, kwargs = fg.fwd_gluon_arguments(
        x.q,
        x.k,
        x.k,
        x.q,
        x.stats,
        x.indices,
        x.counts,
        block_q=block,
        block_k=block,
        scale=x.scale,
        heads_per_program=heads or config.gluon_heads_per_program,
        num_buf=config.gluon_stages,
    )
    compiled = warmup_for_hopper(fg._fwd_gluon_kernel, *args, grid=grid, **kwargs)
    assert "wgmma.mma_async" in compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]
    registers, spills = _ptxas_report(compiled)
    print(
        f"forward block {block} D {head_dim}: {registers} registers, {spills} bytes spilled, "
        f"{compiled.metadata.shared} bytes of shared memory"
    )
    assert spills == 0
    assert compiled.metadata.shared <= 227 * 1024


DOCS_COMPILE_CASES = [
    # block, head dim, group, spill bytes allowed in the KV-centric kernel: with documents its [BK] key ids stay
    # live beside the two fp32 accumulators, which at D = 128 costs a few spilled registers (ptxas of triton 3.6)
    pytest.param(64, 128, 4, 28, id="P64-d128"),
    pytest.param(128, 128, 4, 28, id="P128-d128"),
    pytest.param(64, 64, 4, 0, id="P64-d64"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check of the CPU machine")
@pytest.mark.parametrize("block,head_dim,group,kv_spill_bytes", DOCS_COMPILE_CASES)
def test_gluon_kernels_with_documents_compile_for_hopper(block, head_dim, group, kv_spill_bytes):
    """The three Gluon kernels with the document mask compile to sm_90a at the default tiles; the forward and dQ
    kernels without spills, the KV-centric kernel within the bound above."""
    config = backward_config(group, block, block, head_dim, False, {"kv_gluon": True, "dq_gluon": True})
    fconfig = forward_config(group, block, block, head_dim, {"fwd_gluon": True})
    x = _CompileInputs(block, head_dim, group)
    launches = {
        "forward": (
            fg._fwd_gluon_kernel,
            fg.fwd_gluon_arguments(
                x.q,
                x.k,
                x.k,
                x.q,
                x.stats,
                x.indices,
                x.counts,
                x.docs,
                block_q=block,
                block_k=block,
                scale=x.scale,
                heads_per_program=fconfig.gluon_heads_per_program,
                num_buf=fconfig.gluon_stages,
            ),
            0,
        ),
        "dq": (
            bg._dq_gluon_kernel,
            bg.dq_gluon_arguments(
                x.q,
                x.k,
                x.k,
                x.q,
                x.stats,
                x.stats,
                x.indices,
                x.counts,
                x.q,
                x.docs,
                block_q=block,
                block_k=block,
                scale=x.scale,
                heads_per_program=config.dq_gluon_heads_per_program,
                num_buf=config.dq_gluon_stages,
            ),
            0,
        ),
        "kv": (
            bg._dkdv_gluon_kernel,
            bg.dkdv_gluon_arguments(
                x.q,
                x.k,
                x.k,
                x.q,
                x.stats,
                x.stats,
                x.items,
                x.items,
                x.items,
                x.items,
                x.items,
                x.k,
                x.k,
                x.partials,
                x.partials,
                x.docs,
                block_q=block,
                block_k=block,
                scale=x.scale,
                tile_rows=config.gluon_tile_rows,
                num_buf=config.gluon_stages,
                key_rows=config.gluon_key_rows,
            ),
            kv_spill_bytes,
        ),
    }
    for name, (kernel, (grid, args, kwargs), spill_bytes) in launches.items():
        assert kwargs["HAS_DOCS"]
        compiled = warmup_for_hopper(kernel, *args, grid=grid, **kwargs)
        registers, spills = _ptxas_report(compiled)
        print(f"{name} with documents, block {block} D {head_dim}: {registers} registers, {spills} bytes spilled")
        assert spills <= spill_bytes


def test_forward_config_gluon_default_follows_the_device():
    """``fwd_gluon`` is on by default where :func:`plan.device.gluon_kernels` holds and head dim and key blocks are 64
    (where it measured faster), off on the CPU; the Triton forward's tiles stay its own (it runs wherever the
    Gluon one does not apply)."""
    from sparse_train.plan import tuning

    assert forward_config(4, 64, 64, 64, device="cpu").gluon == 0
    on = forward_config(4, 64, 64, 128, {"fwd_gluon": True})
    assert on.gluon == 1 and on._replace(gluon=0) == forward_config(4, 64, 64, 128)
    assert on.gluon_heads_per_program * 64 == tuning.GLUON_FWD_ROWS and on.gluon_stages == tuning.GLUON_FWD_RING
    assert on.heads_per_program == 4  # the Triton forward's 256 rows at D = 128
    if torch.cuda.is_available():
        hopper = int(torch.cuda.get_device_capability()[0] == 9)
        assert forward_config(4, 64, 64, 64, device="cuda").gluon == hopper
        assert forward_config(4, 64, 64, 128, device="cuda").gluon == 0
        assert forward_config(4, 128, 128, 64, device="cuda").gluon == 0
        assert forward_config(4, 64, 64, 128, {"fwd_gluon": True}, device="cuda").gluon == 1
    with pytest.raises(ValueError, match="fwd_gluon"):
        forward_config(4, 64, 64, 128, {"fwd_gluon": "yes"})


def test_backward_config_gluon_default_follows_the_device():
    """``kv_gluon`` is on by default exactly where :func:`plan.device.gluon_kernels` holds (a Hopper GPU with Gluon),
    off on the CPU; the option overrides it either way, and its tiles are the plan's constants."""
    from sparse_train.plan import tuning

    for name in ("kv_gluon", "dq_gluon"):
        assert getattr(backward_config(4, 64, 64, 128, False, device="cpu"), name) == 0
        assert getattr(backward_config(4, 64, 64, 128, False, {name: True}, device="cpu"), name) == 1
        on = backward_config(4, 64, 64, 128, False, {name: True})
        # the Triton kernels' own tiles stay their tuned ones (they run wherever the Gluon ones do not apply)
        assert on._replace(**{name: 0}) == backward_config(4, 64, 64, 128, False)
        if torch.cuda.is_available():
            expected = int(torch.cuda.get_device_capability()[0] == 9)
            assert getattr(backward_config(4, 64, 64, 128, False, device="cuda"), name) == expected
            assert getattr(backward_config(4, 64, 64, 128, False, {name: False}, device="cuda"), name) == 0
        with pytest.raises(ValueError, match=name):
            backward_config(4, 64, 64, 128, False, {name: "yes"})
    on = backward_config(4, 64, 64, 128, False)
    assert (on.gluon_tile_rows, on.gluon_stages, on.dq_gluon_stages, on.gluon_key_rows) == (
        tuning.GLUON_TILE_ROWS,
        tuning.GLUON_RING,
        tuning.GLUON_DQ_RING,
        tuning.GLUON_KEY_ROWS,
    )
    # the Gluon dQ kernel takes one head of 64 rows, the Triton one stays at two (128 rows); an explicit
    # dq_heads_per_program sets both
    assert (on.dq_gluon_heads_per_program, on.dq_heads_per_program) == (1, 2)
    assert backward_config(4, 32, 32, 128, False).dq_gluon_heads_per_program == 2
    both = backward_config(4, 64, 64, 128, False, {"dq_heads_per_program": 4})
    assert (both.dq_gluon_heads_per_program, both.dq_heads_per_program) == (4, 4)


def test_gluon_fallback_reasons():
    """Each condition the Gluon kernel does not cover is named (the launcher then runs the Triton kernel)."""
    q, k, v = make_qkv(1, 4, 2, 256, 64, torch.bfloat16, device="cpu")
    kw = dict(
        block_q=64,
        block_k=64,
        tile_rows=64,
        heads_per_step=1,
        has_seq_lens=False,
        has_docs=False,
        dropout=False,
        query_map=False,
    )
    assert "Hopper" in bg.gluon_kv_supported(q, k, v, q, **kw)
    assert "Hopper" in bg.gluon_dq_supported(q, k, v, q, **_dq_support_args(kw))
    assert "Hopper" in fg.gluon_fwd_supported(q, k, v, **_fwd_support_args(kw))


@pytest.mark.parametrize(
    "block_k,key_rows,expected",
    [
        (128, 64, None),
        (128, 128, None),
        (64, 64, None),
        (64, 128, None),
        (128, 32, "32 key rows"),
        (128, 96, "96 key rows"),
    ],
    ids=["128-in-two", "128-whole", "64-whole", "64-capped", "too-thin", "not-dividing"],
)
def test_gluon_kv_key_rows(block_k, key_rows, expected):
    """A Gluon KV-centric program takes 64 or 128 rows of its key block (at most the block), a divisor of it;
    anything else is named and the launcher runs the Triton kernel."""
    reason = bg.gluon_kv_tiles_supported(block_q=64, tile_rows=64, heads_per_step=1, block_k=block_k, key_rows=key_rows)
    assert reason is None if expected is None else expected in reason
    assert bg.gluon_kv_key_rows(block_k, key_rows) == min(block_k, key_rows)


def _fwd_support_args(kv_kw, **changes):
    """gluon_fwd_supported's keywords for the case gluon_kv_supported's ``kv_kw`` describes."""
    kw = {name: value for name, value in kv_kw.items() if name not in ("tile_rows", "heads_per_step")}
    return dict(kw, heads_per_program=2, num_splits=1, **changes)


def _dq_support_args(kv_kw, **changes):
    """gluon_dq_supported's keywords for the case gluon_kv_supported's ``kv_kw`` describes."""
    kw = {name: value for name, value in kv_kw.items() if name not in ("tile_rows", "heads_per_step")}
    return dict(kw, heads_per_program=2, has_cold=False, **changes)


@pytest.mark.gpu
def test_gluon_fallback_reasons_on_hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper")
    q, k, v = make_qkv(1, 4, 2, 256, 64, torch.bfloat16, device="cpu")
    _hopper_fallback_reasons(
        q,
        k,
        v,
        dict(
            block_q=64,
            block_k=64,
            tile_rows=64,
            heads_per_step=1,
            has_seq_lens=False,
            has_docs=False,
            dropout=False,
            query_map=False,
        ),
    )


def _hopper_fallback_reasons(q, k, v, kw):
    """On Hopper: supported as given and in the projections' strides; every other condition named."""
    qc, kc, vc = (x.cuda() for x in (q, k, v))
    assert bg.gluon_kv_supported(qc, kc, vc, qc, **kw) is None
    assert "dropout" in bg.gluon_kv_supported(qc, kc, vc, qc, **dict(kw, dropout=True))
    assert "multiple" in bg.gluon_kv_supported(qc[:, :, :250], kc[:, :, :250], vc[:, :, :250], qc[:, :, :250], **kw)
    assert "dtype" in bg.gluon_kv_supported(qc.float(), kc.float(), vc.float(), qc.float(), **kw)
    assert bg.gluon_kv_supported(qc.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, qc, **kw) is None
    misaligned = torch.empty(qc.numel() + 1, device="cuda", dtype=qc.dtype)[1:].view(qc.shape)
    assert "layout" in bg.gluon_kv_supported(misaligned, kc, vc, qc, **kw)
    dq_kw = _dq_support_args(kw)
    assert bg.gluon_dq_supported(qc, kc, vc, qc, **dq_kw) is None
    assert "cold" in bg.gluon_dq_supported(qc, kc, vc, qc, **dict(dq_kw, has_cold=True))
    assert "rows per program" in bg.gluon_dq_supported(qc, kc, vc, qc, **dict(dq_kw, heads_per_program=4))
    assert "layout" in bg.gluon_dq_supported(misaligned, kc, vc, qc, **dq_kw)
    fwd_kw = _fwd_support_args(kw)
    assert fg.gluon_fwd_supported(qc, kc, vc, **fwd_kw) is None
    assert "splits" in fg.gluon_fwd_supported(qc, kc, vc, **dict(fwd_kw, num_splits=2))
    assert "dropout" in fg.gluon_fwd_supported(qc, kc, vc, **dict(fwd_kw, dropout=True))
    # packed documents are within every Gluon kernel
    assert fg.gluon_fwd_supported(qc, kc, vc, **dict(fwd_kw, has_docs=True)) is None
    assert bg.gluon_dq_supported(qc, kc, vc, qc, **dict(dq_kw, has_docs=True)) is None
    assert bg.gluon_kv_supported(qc, kc, vc, qc, **dict(kw, has_docs=True)) is None


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
    reason="on Hopper the Gluon kernel runs (the GPU tests below)",
)
@pytest.mark.usefixtures("poison_fresh_outputs")
def test_without_hopper_gluon_options_run_the_triton_kernels_bitwise():
    """Off Hopper (here the interpreter) ``kv_gluon`` / ``dq_gluon`` change nothing: the Triton kernels run,
    same bits."""
    idx = random_index(1, 2, 128, 32, 32, 2, 1, 1, seed=3)
    q, k, v = make_qkv(1, 4, 2, 128, 32, torch.float32, device="cpu")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))

    def grads(options):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = triton_sparse_attention(qs, ks, vs, idx, kernel_options=options)
        return torch.autograd.grad(o, (qs, ks, vs), do)

    plain = grads(None)
    gluon = grads({"kv_gluon": True, "dq_gluon": True, "fwd_gluon": True})
    assert all(torch.equal(a, b) for a, b in zip(plain, gluon))


GPU_CASES = [
    # B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks, kv_chunk (None: the default), projection layout
    # ([B, N, H, D] memory, as the module passes it)
    pytest.param(2, 8, 2, 4096, 128, 64, 64, torch.bfloat16, 8, 4, 1, None, False, id="bf16-d128-b64-gqa4"),
    pytest.param(1, 8, 8, 8192, 64, 128, 128, torch.float16, 6, 2, 1, None, False, id="fp16-d64-b128-8k-mha"),
    pytest.param(1, 8, 2, 4096, 128, 128, 64, torch.bfloat16, 8, 4, 1, 2, False, id="bf16-d128-bq128-bk64-chunks2"),
    pytest.param(
        1,
        4,
        1,
        3136,
        64,
        64,
        128,
        torch.float16,
        5,
        2,
        1,
        3,
        False,
        id="fp16-d64-bq64-bk128-gqa4-chunks3-N_not_multiple_of_BK",
    ),
    pytest.param(1, 8, 2, 8192, 128, 128, 128, torch.bfloat16, 8, 4, 1, None, False, id="bf16-d128-b128-8k"),
    pytest.param(2, 8, 2, 4096, 128, 64, 64, torch.bfloat16, 8, 4, 1, None, True, id="bf16-d128-b64-projection-layout"),
    pytest.param(
        1,
        8,
        8,
        3200,
        64,
        64,
        128,
        torch.bfloat16,
        6,
        2,
        1,
        None,
        True,
        id="bf16-d64-bq64-bk128-projection-layout-N_not_multiple_of_BK",
    ),
]


@pytest.fixture
def poison_fresh_gradients(monkeypatch):
    """As conftest's ``poison_fresh_outputs``, for ``torch.empty_like`` too (the launcher allocates dK and dV in
    k's and v's layouts with it): a row the Gluon kernel leaves unwritten shows up as NaN."""
    real_empty_like = torch.empty_like

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty_like", empty_like)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_fresh_outputs", "poison_fresh_gradients")
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks,kv_chunk,projection_layout", GPU_CASES)
def test_gluon_backward_on_gpu(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks, kv_chunk, projection_layout):
    """``kernel_options.kv_gluon`` on the H200: the Gluon kernel runs and o, dq, dk, dv match the fp32
    reference at real sizes (fresh outputs NaN-poisoned); dq is bitwise the Triton path's (the dQ kernel is the
    same: the Triton one on both sides), and so are dk and dv (same tile products, accumulated in the same
    order)."""
    from test_kernel_backward import _gpu_compare

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper")
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    if projection_layout:  # same values in [B, N, H, D] memory: the descriptors take the strides
        q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    chunk = {} if kv_chunk is None else {"kv_chunk": kv_chunk}
    _, _, _, (dq, dk, dv) = _gpu_compare(idx, q, k, v, do, kernel_options=dict(chunk, kv_gluon=True, dq_gluon=False))
    assert kb.LAST_COMPILED["dkdv"].name == "_dkdv_gluon_kernel"
    _, _, _, (dq_triton, dk_triton, dv_triton) = _gpu_compare(
        idx, q, k, v, do, kernel_options=dict(chunk, kv_gluon=False, dq_gluon=False)
    )
    assert kb.LAST_COMPILED["dkdv"].name == "_dkdv_kernel"
    print(
        f"max |dK gluon - dK triton| {float((dk.float() - dk_triton.float()).abs().max()):.3g}, "
        f"|dV| {float((dv.float() - dv_triton.float()).abs().max()):.3g}"
    )
    assert torch.equal(dq, dq_triton) and torch.equal(dk, dk_triton) and torch.equal(dv, dv_triton)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_fresh_outputs", "poison_fresh_gradients")
@pytest.mark.parametrize(
    "B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks,kv_chunk,projection_layout",
    [case for case in GPU_CASES if case.values[6] == 128],
)
def test_gluon_kv_key_slices_on_gpu(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks, kv_chunk, projection_layout):
    """Over 128-key blocks the Gluon KV-centric kernel runs each block as two 64-key-row programs (the default,
    ``plan.tuning.GLUON_KEY_ROWS``) or as one 128-row program: dK and dV are the same bits (each key row gets the same
    products in the same order; the dQ kernel is the same), NaN-poisoned outputs, chunked rows included."""
    from sparse_train.kernels.triton.backward import sparse_attn_backward
    from sparse_train.kernels.triton.forward import sparse_attn_forward
    from sparse_train.plan.launch import attention_schedule

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper")
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N + 3, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q)
    if projection_layout:
        q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    options = {"kv_gluon": True} if kv_chunk is None else {"kv_gluon": True, "kv_chunk": kv_chunk}
    sched = attention_schedule(idx, HQ // HKV, D, q.device, options)
    assert sched.backward.gluon_key_rows == 64
    o, lse = sparse_attn_forward(
        q, k, v, idx.indices, idx.counts, block_q=BQ, block_k=BK, scale=D**-0.5, num_splits=1, config=sched.forward
    )

    def backward(key_rows):
        config = sched.backward._replace(gluon_key_rows=key_rows)
        grads = sparse_attn_backward(
            do,
            q,
            k,
            v,
            o,
            lse,
            idx.indices,
            idx.counts,
            sched.plan.kv_indptr,
            sched.plan.kv_qblocks,
            sched.slots,
            sched.cold_capacity,
            block_q=BQ,
            block_k=BK,
            scale=D**-0.5,
            config=config,
        )
        compiled = kb.LAST_COMPILED["dkdv"]
        assert compiled.name == "_dkdv_gluon_kernel"
        return grads, compiled.metadata.num_warps

    (dq2, dk2, dv2), warps2 = backward(64)
    (dq1, dk1, dv1), warps1 = backward(128)
    assert (warps2, warps1) == (4, 8)
    assert not dk2.isnan().any() and not dv2.isnan().any()
    assert torch.equal(dk2, dk1) and torch.equal(dv2, dv1) and torch.equal(dq2, dq1)


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_fresh_outputs", "poison_fresh_gradients")
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks,kv_chunk,projection_layout", GPU_CASES)
def test_gluon_dq_on_gpu(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks, kv_chunk, projection_layout):
    """``kernel_options.dq_gluon`` on the H200: the Gluon dQ kernel runs and o, dq, dk, dv match the fp32
    reference at real sizes (fresh outputs NaN-poisoned); dq is bitwise the Triton dQ kernel's (same tile
    products in the same order), dk and dv too (the same KV-centric kernel on both sides)."""
    from test_kernel_backward import _gpu_compare

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper")
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N + 1, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q)
    if projection_layout:  # same values in [B, N, H, D] memory: the descriptors take the strides
        q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    chunk = {} if kv_chunk is None else {"kv_chunk": kv_chunk}
    _, _, _, gluon = _gpu_compare(idx, q, k, v, do, kernel_options=dict(chunk, dq_gluon=True))
    assert kb.LAST_COMPILED["dq"].name == "_dq_gluon_kernel"
    _, _, _, plain = _gpu_compare(idx, q, k, v, do, kernel_options=dict(chunk, dq_gluon=False))
    assert kb.LAST_COMPILED["dq"].name == "_dq_kernel"
    print(f"max |dQ gluon - dQ triton| {float((gluon[0].float() - plain[0].float()).abs().max()):.3g}")
    assert all(torch.equal(a, b) for a, b in zip(gluon, plain))


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_fresh_outputs", "poison_fresh_gradients")
@pytest.mark.parametrize("B,HQ,HKV,N,D,BQ,BK,dtype,topk,window,sinks,kv_chunk,projection_layout", GPU_CASES)
def test_gluon_forward_on_gpu(B, HQ, HKV, N, D, BQ, BK, dtype, topk, window, sinks, kv_chunk, projection_layout):
    """``kernel_options.fwd_gluon`` on the H200 (one split per row, the Gluon forward's condition): it runs and
    o, dq, dk, dv match the fp32 reference at real sizes (fresh outputs NaN-poisoned); o and lse equal the Triton
    forward's bit for bit (same products in the same order), also with a ring of 3."""
    from test_kernel_backward import _gpu_compare

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper")
    idx = random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=N + 2, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    if projection_layout:  # same values in [B, N, H, D] memory: the descriptors take the strides
        q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    o, lse, _, _ = _gpu_compare(idx, q, k, v, do, kernel_options={"fwd_gluon": True, "num_splits": 1})
    assert kb.LAST_COMPILED["fwd"].name == "_fwd_gluon_kernel"
    o_triton, lse_triton, _, _ = _gpu_compare(idx, q, k, v, do, kernel_options={"fwd_gluon": False, "num_splits": 1})
    assert kb.LAST_COMPILED["fwd"].name == "_fwd_kernel"
    print(
        f"max |o gluon - o triton| {float((o.float() - o_triton.float()).abs().max()):.3g}, "
        f"|lse| {float((lse - lse_triton).abs().max()):.3g}, bitwise o {torch.equal(o, o_triton)}"
    )
    from sparse_train.kernels.triton.forward import sparse_attn_forward
    from sparse_train.plan.launch import attention_schedule

    assert torch.equal(o, o_triton) and torch.equal(lse, lse_triton)
    sched = attention_schedule(idx, HQ // HKV, D, q.device, {"fwd_gluon": True})
    ring3 = sched.forward._replace(gluon_stages=3)
    o3, lse3 = sparse_attn_forward(
        q, k, v, idx.indices, idx.counts, block_q=BQ, block_k=BK, scale=D**-0.5, num_splits=1, config=ring3
    )
    assert kb.LAST_COMPILED["fwd"].name == "_fwd_gluon_kernel"
    assert torch.equal(o3, o) and torch.equal(lse3, lse)


DOCS_GPU_CASES = [
    # B, HQ, HKV, N, D, block, document lengths (low, high), dtype
    pytest.param(2, 8, 2, 4096, 128, 64, (100, 900), torch.bfloat16, id="bf16-d128-b64-docs-100-900"),
    pytest.param(1, 8, 2, 8192, 128, 128, (300, 3000), torch.bfloat16, id="bf16-d128-b128-docs-300-3000"),
    pytest.param(1, 8, 8, 4096, 64, 64, (50, 400), torch.float16, id="fp16-d64-b64-mha-docs-50-400"),
]


@pytest.mark.gpu
@pytest.mark.usefixtures("poison_fresh_outputs", "poison_fresh_gradients")
@pytest.mark.parametrize("B,HQ,HKV,N,D,block,lengths,dtype", DOCS_GPU_CASES)
def test_gluon_kernels_with_documents_on_gpu(B, HQ, HKV, N, D, block, lengths, dtype):
    """Packed documents on the H200 through all three Gluon kernels (one split per row): o, lse, dq, dk, dv
    against the float64 reference with the same document ids (error ratio, as test_kernel_documents.py), and
    bitwise the all-Triton path's (same products and masks in the same order)."""
    from test_kernel_documents import _check_against_reference

    from sparse_train.documents import random_document_lengths

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper")
    ids = torch.cat(
        [
            torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
            for lens in (random_document_lengths(N, *lengths, seed) for seed in range(B))
        ]
    )
    ids = ids.view(B, N).to(device="cuda", dtype=torch.int32)
    idx = random_index(B, HKV, N, block, block, 8, 4, 1, seed=N + 5, device="cuda")
    q, k, v = make_qkv(B, HQ, HKV, N, D, dtype, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q)
    on = {"fwd_gluon": True, "dq_gluon": True, "kv_gluon": True, "num_splits": 1}
    gluon = _check_against_reference(idx, q, k, v, do, ids, dtype=dtype, kernel_options=on)
    assert [kb.LAST_COMPILED[name].name for name in ("fwd", "dq", "dkdv")] == [
        "_fwd_gluon_kernel",
        "_dq_gluon_kernel",
        "_dkdv_gluon_kernel",
    ]
    off = {"fwd_gluon": False, "dq_gluon": False, "kv_gluon": False, "num_splits": 1}
    plain = _check_against_reference(idx, q, k, v, do, ids, dtype=dtype, kernel_options=off)
    assert kb.LAST_COMPILED["dkdv"].name == "_dkdv_kernel"
    assert all(torch.equal(a, b) for a, b in zip(gluon, plain))


@pytest.mark.gpu
def test_gluon_dq_leaves_cold_blocks_to_the_triton_kernel():
    """With cold blocks (r0 above the smallest reuse) the dQ kernel also adds their dK/dV by atomics, which the
    Gluon kernel does not: the Triton dQ kernel runs under ``dq_gluon`` and the gradients match the reference."""
    from test_kernel_backward import _gpu_compare

    idx = random_index(1, 2, 4096, 64, 64, 8, 4, 1, seed=11, device="cuda")
    q, k, v = make_qkv(1, 8, 2, 4096, 128, torch.bfloat16, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    _gpu_compare(idx, q, k, v, do, kernel_options={"dq_gluon": True, "r0": 4})
    assert kb.LAST_COMPILED["dq"].name == "_dq_kernel"


@pytest.mark.gpu
def test_gluon_falls_back_where_it_does_not_apply():
    """Dropout and a length that is not a multiple of BLOCK_Q take the Triton kernel under ``kv_gluon``,
    with the Triton kernel's gradients (bitwise: deterministic mode on both sides)."""
    from test_kernel_backward import _gpu_compare

    idx = random_index(1, 2, 4099, 64, 64, 8, 4, 1, seed=7, device="cuda")
    q, k, v = make_qkv(1, 8, 2, 4099, 128, torch.bfloat16, device="cuda")
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    for kw in (dict(), dict(dropout_p=0.1, dropout_seed=3)):
        _, _, _, gluon = _gpu_compare(
            idx, q, k, v, do, kernel_options={"kv_gluon": True, "dq_gluon": True}, deterministic=True, **kw
        )
        assert kb.LAST_COMPILED["dkdv"].name == "_dkdv_kernel"
        assert kb.LAST_COMPILED["dq"].name == "_dq_kernel"
        _, _, _, plain = _gpu_compare(
            idx, q, k, v, do, kernel_options={"kv_gluon": False, "dq_gluon": False}, deterministic=True, **kw
        )
        assert all(torch.equal(a, b) for a, b in zip(gluon, plain))
