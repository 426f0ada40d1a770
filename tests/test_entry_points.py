"""Property-based tests (hypothesis) of every public entry point: ``sparse_attention``, the ``BlockIndex``
constructors, ``SparseAttention`` with its ``SparseAttentionConfig`` and ``KernelOptions``, ``hf.enable`` and
``enable_context_parallel``.

Each property draws the documented arguments of one entry point, every range probed at its ends (0, 1, the
largest value, a block size past N, a window past the row, a seed of 2**64 - 1, ...) and just past them, in every
grad mode, on both backends (the Triton kernels through the interpreter on the CPU), with B = 0 and N = 1 among
the explicit examples, and asserts:

* a valid call matches the float64 reference: `builders.dense_oracle` for attention (the reference backend to
  1e-9, the kernels by the error-ratio rule of `builders.check_close`), a plain-Python construction of the
  block set for the index, the module's own selection (or the full causal index on its dense paths) through the
  oracle for ``SparseAttention``;
* an invalid call (exactly one argument just past its range, the others drawn valid) raises ``ValueError``
  whose message names that argument; another exception type, wrong numbers or a hang fail;
* outputs are equal across ``enable_grad`` / ``no_grad`` / ``inference_mode`` and gradients exist only where
  enabled; under activation checkpointing (non-reentrant, reentrant, selective, Hugging Face's) the output, the
  input gradients and the selector gradients equal the un-checkpointed call's;
* ``kernel_options`` typed and as a dict give the same result or the same message.

The one-message-per-bad-value tables of ``tests/test_api_validation.py`` and ``tests/test_config_validation.py``
and the kernel properties of ``tests/test_properties.py`` are not repeated here. Multi-process context
parallelism is tested in ``tests/parallel``; here ``enable_context_parallel`` runs in this process only (its
argument checks, and a world of one). Bounded for CI: the derandomized "ci" profile of conftest.py and a fixed
``max_examples`` per property (``HYPOTHESIS_PROFILE=explore`` draws fresh examples).
"""

from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import dataclass, field, replace

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from builders import check_close, dense_oracle, make_qkv, outputs_and_grads, random_selection  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import sparse_train as st  # noqa: E402
from sparse_train.kernels.reference.attention import reference_sparse_attention  # noqa: E402
from sparse_train.validation import draw_dropout_seed  # noqa: E402

TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPE = torch.float16 if DEV == "cuda" else torch.float32
BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param(
        "triton", id="triton", marks=pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
    ),
]
GRAD_MODES = ("enable_grad", "no_grad", "inference_mode")
SEED_ENDS = (0, 1, 2**63 - 1, 2**63, 2**64 - 1)
TINY = 5e-324  # the smallest positive float
BIG = 10**9  # a size far past every row, block count and budget of these shapes
JUST_BELOW_ONE = 1.0 - 2**-24  # a dropout_p just below its bound of 1 (scale 2**24 on a kept probability)


def grad_mode(name: str):
    return {"enable_grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[name]()


def raised(call) -> str:
    """The ValueError message of ``call()`` (any other exception propagates and fails the test)."""
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def assert_names(message: str, label: str) -> None:
    assert label in message, f"the error does not name {label!r}: {message}"


def query_block_rows(blocks: list[int], seq_len: int, block_q: int) -> list[int]:
    """The rows of q under ``query_blocks``: each listed block's positions, in the listed order."""
    return [p for b in blocks for p in range(b * block_q, min((b + 1) * block_q, seq_len))]


# ============================================================================================ sparse_attention
@dataclass(frozen=True)
class AttentionCall:
    """One drawn ``sparse_attention`` call; tensors come from ``seed``. ``options``: kernel_options items,
    ``("plan", r0)`` standing for ``index.plan(r0)``."""

    backend: str = "reference"
    batch: int = 1
    kv_heads: int = 1
    group: int = 2
    seq_len: int = 33
    head_dim: int = 16
    block_q: int = 16
    block_k: int = 16
    topk: int = 2
    window: int = 1
    sinks: int = 1
    scale: float | None = None
    dropout_p: float = 0.0
    dropout_seed: int | None = 7
    seq_lens: str = "none"  # none | zeros | full | random
    documents: str = "none"  # none | one | each-token | random | top-ids
    query_blocks: str = "none"  # none | first | last | shuffled
    options: tuple = ()
    form: str = "dict"  # dict | typed
    return_lse: bool = True
    deterministic: bool = False
    check_values: bool = True
    grad_mode: str = "enable_grad"
    seed: int = 0


def _document_ids(kind: str, batch: int, n: int, generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "one":
        return torch.zeros(batch, n, dtype=torch.int64)
    if kind == "each-token":
        return torch.arange(n).expand(batch, n).contiguous()
    starts = (torch.rand(batch, n, generator=generator) < 0.15).long()
    starts[:, 0] = 0
    ids = torch.cumsum(starts, dim=1)
    return ids + (2**31 - 1 - ids[:, -1:]) if kind == "top-ids" else ids.int()  # top-ids: the last is 2**31 - 1


@dataclass
class BuiltCall:
    index: st.BlockIndex
    clean: list  # float64 q (all N rows), k, v
    rows: list | None  # the rows of q under query_blocks
    kwargs: dict = field(default_factory=dict)  # every argument of sparse_attention but q, k, v, index
    options: dict = field(default_factory=dict)  # kernel_options as a dict


def build_attention_call(call: AttentionCall) -> BuiltCall:
    g = torch.Generator().manual_seed(call.seed)
    b, hkv, n = call.batch, call.kv_heads, call.seq_len
    sel = random_selection(b, hkv, n, call.block_q, call.block_k, call.topk, generator=g, distinct=False, drop=0.2)
    index = st.BlockIndex.from_selection(
        sel.to(DEV), seq_len=n, block_q=call.block_q, block_k=call.block_k, window=call.window, sinks=call.sinks
    )
    seq_lens = {
        "none": None,
        "zeros": torch.zeros(b, dtype=torch.int64),
        "full": torch.full((b,), n, dtype=torch.int32),
        "random": torch.randint(0, n + 1, (b,), generator=g),
    }[call.seq_lens]
    documents = _document_ids(call.documents, b, n, g)
    clean = make_qkv(b, hkv * call.group, hkv, n, call.head_dim, torch.float64, generator=g, device=DEV)
    nqb = index.num_q_blocks
    blocks = {
        "none": None,
        "first": [0],
        "last": [nqb - 1],
        "shuffled": torch.randperm(nqb, generator=g)[: max(1, nqb // 2)].tolist(),
    }[call.query_blocks]
    options = {name: index.plan(value) if name == "plan" else value for name, value in call.options}
    kwargs = dict(
        scale=call.scale,
        dropout_p=call.dropout_p,
        dropout_seed=call.dropout_seed,
        seq_lens=None if seq_lens is None else seq_lens.to(DEV),
        document_ids=None if documents is None else documents.to(DEV),
        return_lse=call.return_lse,
        deterministic=call.deterministic,
        backend=call.backend,
        check_values=call.check_values,
        query_blocks=None if blocks is None else torch.tensor(blocks, dtype=torch.int64, device=DEV),
    )
    rows = None if blocks is None else query_block_rows(blocks, n, call.block_q)
    return BuiltCall(index, clean, rows, kwargs, options)


def _kernel_options(built: BuiltCall, form: str):
    if not built.options:
        return None
    return st.KernelOptions(**built.options) if form == "typed" else dict(built.options)


@hs.composite
def kernel_option_items(draw, backend: str, group: int, block_q: int, deterministic: bool):
    """kernel_options at the ends of each field's range, as the shapes allow (the Triton launches of 64 splits
    and of 16 warps cost seconds in the interpreter, so they are drawn on the reference, which validates and
    ignores them)."""
    kernel = backend == "triton"
    heads = [h for h in (1, 2, 4) if group % h == 0]
    choices = {
        "r0": (0, 1, BIG),
        "num_splits": (1, 2) if kernel else (1, 64),
        "fwd_heads_per_program": heads,
        "dq_heads_per_program": heads,
        "kv_heads_per_program": heads,
        "fwd_num_warps": (1, 4) if kernel else (1, 16),
        "dq_num_warps": (1, 4) if kernel else (1, 16),
        "kv_num_warps": (1, 4) if kernel else (1, 16),
        "fwd_num_stages": (1, 8),
        "dq_num_stages": (1, 8),
        "kv_num_stages": (1, 8),
        "kv_chunk": (1, BIG),
        "fwd_tma": (False, True),
        "dq_tma": (False, True),
        "kv_tma": (False, True),
        "kv_gluon": (False, True),
        "dq_gluon": (False, True),
        "fwd_gluon": (False, True),
        "stored_ds": (False, True),
    }
    names = draw(hs.lists(hs.sampled_from(sorted(choices)), max_size=4, unique=True))
    items = {name: draw(hs.sampled_from(choices[name])) for name in names}
    tile = items.get("kv_heads_per_program", 1) * block_q  # the KV-centric tile's rows
    if tile >= 16 and draw(hs.booleans()):
        items["kv_tile_rows"] = draw(hs.sampled_from([rows for rows in (16, 32, 64) if rows <= tile]))
    if not deterministic and not items.get("stored_ds") and draw(hs.booleans()):
        items["fused_dq"] = True
    if draw(hs.booleans()):
        items["plan"] = items.get("r0")  # index.plan(r0) of this very index
    return tuple(sorted(items.items()))


@hs.composite
def attention_calls(draw, backend: str | None = None):
    """A valid call; the Triton draws stay small (each interpreted launch costs tenths of a second)."""
    backend = backend or draw(hs.sampled_from(("reference", "triton")))
    kernel = backend == "triton"
    blocks = (16, 32) if kernel else (1, 16, 32, 128, BIG)
    block_q, block_k = draw(hs.sampled_from(blocks)), draw(hs.sampled_from(blocks))
    max_len = 40 if kernel else 48
    seq_len = draw(hs.sampled_from((1, 2, block_q - 1, block_q, block_q + 1, max_len)) | hs.integers(1, max_len))
    seq_len = min(max(seq_len, 1), max_len)
    group = draw(hs.sampled_from((1, 2)) if kernel else hs.sampled_from((1, 2, 3)))
    deterministic = draw(hs.booleans())
    query_blocks = draw(hs.sampled_from(("none", "none", "first", "last", "shuffled")))
    options = draw(kernel_option_items(backend, group, block_q, deterministic))
    if query_blocks != "none":
        options = tuple(item for item in options if item[0] != "plan")
    return AttentionCall(
        backend=backend,
        batch=draw(hs.sampled_from((0, 1, 1, 2))),
        kv_heads=draw(hs.sampled_from((1, 2))) if not kernel else 1,
        group=group,
        seq_len=seq_len,
        head_dim=16 if kernel else draw(hs.sampled_from((1, 3, 16))),
        block_q=block_q,
        block_k=block_k,
        topk=draw(hs.integers(0, 3)),
        window=draw(hs.sampled_from((0, 1, 2, BIG))),
        sinks=draw(hs.sampled_from((0, 1, BIG))),
        scale=draw(hs.sampled_from((None, 0.0, -1.0, TINY, 2.0)) | hs.floats(-3.0, 3.0)),
        dropout_p=draw(hs.sampled_from((0.0, 0.0, 0.0, 0.5, JUST_BELOW_ONE))),
        dropout_seed=draw(hs.sampled_from((None, *SEED_ENDS)) | hs.integers(0, 2**64 - 1)),
        seq_lens=draw(hs.sampled_from(("none", "none", "zeros", "full", "random"))),
        documents=draw(hs.sampled_from(("none", "none", "one", "each-token", "random", "top-ids"))),
        query_blocks=query_blocks,
        options=options,
        form=draw(hs.sampled_from(("dict", "typed"))),
        return_lse=draw(hs.booleans()),
        deterministic=deterministic,
        check_values=draw(hs.booleans()),
        grad_mode=draw(hs.sampled_from(GRAD_MODES)),
        seed=draw(hs.integers(0, 2**31 - 1)),
    )


def _oracle_call(call: AttentionCall, built: BuiltCall, dropout_seed):
    """(q_local, k, v) -> (o, lse) of the float64 oracle on the rows of q the call computes."""
    q_full = built.clean[0]
    rows = None if built.rows is None else torch.tensor(built.rows, dtype=torch.int64, device=DEV)
    kw = built.kwargs

    def run(q, k, v):
        full = q if rows is None else q_full.index_copy(2, rows, q)
        o, lse = dense_oracle(
            full,
            k,
            v,
            built.index,
            kw["seq_lens"],
            call.dropout_p,
            dropout_seed,
            scale=call.scale,
            document_ids=kw["document_ids"],
        )
        return (o, lse) if rows is None else (o.index_select(2, rows), lse.index_select(2, rows))

    return run


def _upstream(seed: int, q: torch.Tensor, with_lse: bool):
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(q.shape, generator=g, dtype=torch.float64).to(DEV)
    dl = torch.randn(q.shape[:3], generator=g, dtype=torch.float64).to(DEV)
    return do, dl if with_lse else torch.zeros_like(dl)


def check_attention_call(call: AttentionCall) -> None:
    """The drawn call against the float64 oracle: o (and lse) in the drawn grad mode, dq, dk, dv where enabled.
    The reference backend in float64 to 1e-9; the kernels by the error-ratio rule against PyTorch in their
    precision on the same index."""
    built = build_attention_call(call)
    dtype = torch.float64 if call.backend == "reference" else KERNEL_DTYPE
    seed = call.dropout_seed
    if call.dropout_p > 0 and seed is None:  # drawn by sparse_attention from the global generator
        torch.manual_seed(call.seed)
        seed = draw_dropout_seed()
    q, k, v = built.clean
    clean = [q if built.rows is None else q[:, :, built.rows], k, v]
    do, dl = _upstream(call.seed, clean[0], call.return_lse)
    want = outputs_and_grads(_oracle_call(call, built, seed), *clean, do, dl)
    options = _kernel_options(built, call.form)
    inputs = [t.to(dtype) for t in clean]

    def attend(q, k, v):
        torch.manual_seed(call.seed)
        out = st.sparse_attention(q, k, v, built.index, kernel_options=options, **built.kwargs)
        return out if call.return_lse else (out, torch.zeros(q.shape[:3], dtype=torch.float64, device=q.device))

    if call.grad_mode == "enable_grad":
        got = outputs_and_grads(attend, *inputs, do, dl)
        assert got[0].requires_grad
    else:
        leaves = [t.detach().requires_grad_() for t in inputs]
        with grad_mode(call.grad_mode):
            got = attend(*leaves)
        assert not got[0].requires_grad and got[0].grad_fn is None
        assert got[0].is_inference() == (call.grad_mode == "inference_mode")
    o, lse = got[:2]
    assert o.dtype == dtype and o.shape == clean[0].shape
    if call.return_lse:
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert lse.shape == clean[0].shape[:3]
    lowp = None
    if dtype != torch.float64:
        lowp = outputs_and_grads(
            lambda a, b, c: reference_sparse_attention(
                a,
                b,
                c,
                built.index,
                scale=call.scale,
                dropout_p=call.dropout_p,
                dropout_seed=seed,
                seq_lens=built.kwargs["seq_lens"],
                document_ids=built.kwargs["document_ids"],
                query_blocks=built.kwargs["query_blocks"],
                upcast=False,
            ),
            *inputs,
            do,
            dl,
        )
    for i, (name, a) in enumerate(zip(("o", "lse", "dq", "dk", "dv"), got)):
        if name == "lse" and not call.return_lse:
            continue
        assert not torch.isnan(a).any(), f"{name} has NaN"
        if lowp is None:
            torch.testing.assert_close(a, want[i], rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
        else:
            check_kernel(name, a, want[i], lowp[i].to(a.dtype), dtype)


def check_kernel(name, got, want, lowp, dtype) -> None:
    """The error-ratio rule of `builders.check_close`, or where the float64 value is exactly zero (dq of a row with
    one key: the softmax has no gradient there) a bound on the rounding left in its place."""
    if want.numel() and not want.abs().max():
        assert got.abs().max() <= 1e-4, f"{name}: {got.abs().max():.3e} where the exact value is 0"
        return
    check_close(name, got, want, lowp, dtype)


# B = 0 and N = 1 on both backends, the block larger than N, every hazard of the range ends at once
ATTENTION_EXAMPLES = [
    AttentionCall(batch=0, seq_len=1),
    AttentionCall(batch=0, seq_len=40, seq_lens="random", documents="random", query_blocks="shuffled"),
    AttentionCall(batch=2, seq_len=1, group=1, window=0, sinks=0, topk=0),
    AttentionCall(batch=1, seq_len=1, dropout_p=JUST_BELOW_ONE, dropout_seed=2**64 - 1, return_lse=False),
    AttentionCall(
        batch=2,
        seq_len=40,
        block_q=32,
        block_k=16,
        window=BIG,
        sinks=BIG,
        scale=0.0,
        dropout_p=0.5,
        dropout_seed=None,
        seq_lens="random",
        documents="top-ids",
        query_blocks="last",
        options=(("kv_chunk", 1), ("num_splits", 2), ("r0", 0), ("stored_ds", True)),
        form="typed",
        deterministic=True,
        seed=3,
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20)
@given(data=hs.data())
def test_sparse_attention_matches_the_oracle_at_the_range_ends(backend, data):
    """Every argument of sparse_attention drawn at the ends of its range (see :func:`attention_calls`), in a drawn
    grad mode: o, lse and where enabled dq, dk, dv against the float64 oracle."""
    check_attention_call(data.draw(attention_calls(backend)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "call",
    ATTENTION_EXAMPLES,
    ids=["B0-N1", "B0-every-mask", "N1-nothing-selected", "N1-dropout-below-one", "all-ends"],
)
def test_sparse_attention_matches_the_oracle_on_the_explicit_ends(backend, call):
    check_attention_call(replace(call, backend=backend))


# ------------------------------------------------------------------------- sparse_attention: past the ends
@dataclass(frozen=True)
class Fault:
    """One argument just past its range: ``apply(args, call)`` rewrites the call's arguments (a dict of q, k, v,
    index, the keyword arguments and ``options``, the kernel_options dict); ``needs(call)`` makes a drawn call
    one the fault is an error for (the values of seq_lens and document_ids are only read with
    ``check_values``, a B = 0 tensor holds no value); the message must contain ``label``."""

    label: str
    apply: object
    needs: object = None
    option: bool = False  # a kernel option: both forms are called and must give the same message


def _set(**values):
    return lambda args, call: args.update(values)


def _option(**values):
    return lambda args, call: args["options"].update(values)


def _checked_values(call):
    return replace(call, batch=max(call.batch, 1), check_values=True)


def _checked_rows(call):
    return replace(_checked_values(call), seq_len=max(call.seq_len, 2))


def _batch_column(value):
    return lambda args, call: args.update(seq_lens=torch.full((call.batch,), value, dtype=torch.int64, device=DEV))


def _documents(first, second):
    def apply(args, call):
        ids = torch.zeros(call.batch, call.seq_len, dtype=torch.int64, device=DEV)
        ids[:, 0], ids[:, 1:] = first, second
        args.update(document_ids=ids)

    return apply


def _query_blocks(ids):
    def apply(args, call):
        nqb = args["index"].num_q_blocks
        blocks = [nqb if i == "NQB" else i for i in ids]
        args["q"] = args["q_full"][:, :, : call.block_q * max(1, len(blocks))]
        args["query_blocks"] = torch.tensor(blocks, dtype=torch.int64, device=DEV)

    return apply


def _heads_not_dividing(args, call):
    return 2 if call.group % 2 else 2 * call.group


ATTENTION_FAULTS = {
    "dropout_p=1": Fault("dropout_p", _set(dropout_p=1.0)),
    "dropout_p=-tiny": Fault("dropout_p", _set(dropout_p=-TINY)),
    "dropout_seed=-1": Fault("dropout_seed", _set(dropout_seed=-1)),
    "dropout_seed=2**64": Fault("dropout_seed", _set(dropout_seed=2**64)),
    "scale=inf": Fault("scale", _set(scale=math.inf)),
    "scale=nan": Fault("scale", _set(scale=math.nan)),
    "seq_lens=N+1": Fault("seq_lens", lambda a, c: _batch_column(c.seq_len + 1)(a, c), _checked_values),
    "seq_lens=-1": Fault("seq_lens", _batch_column(-1), _checked_values),
    "seq_lens-of-another-batch": Fault(
        "seq_lens", lambda a, c: a.update(seq_lens=torch.zeros(c.batch + 1, dtype=torch.int64, device=DEV))
    ),
    "document_ids=2**31": Fault("document_ids", _documents(2**31, 2**31), _checked_values),
    "document_ids=-1": Fault("document_ids", _documents(-1, 0), _checked_values),
    "document_ids-decreasing": Fault("document_ids", _documents(1, 0), _checked_rows),
    "document_ids-int16": Fault(
        "document_ids",
        lambda a, c: a.update(document_ids=torch.zeros(c.batch, c.seq_len, dtype=torch.int16, device=DEV)),
    ),
    "query_blocks-empty": Fault("query_blocks", _query_blocks([])),
    "query_blocks=NQB": Fault("query_blocks", _query_blocks(["NQB"]), _checked_values),
    "query_blocks-repeated": Fault("query_blocks", _query_blocks([0, 0]), _checked_values),
    "backend=Triton": Fault("backend", _set(backend="Triton")),
    "return_lse=1": Fault("return_lse", _set(return_lse=1)),
    "deterministic=yes": Fault("deterministic", _set(deterministic="yes")),
    "check_values=0": Fault("check_values", _set(check_values=0)),
    "head_dim=0": Fault("head dim", lambda a, c: a.update({n: a[n][..., :0] for n in ("q", "k", "v")})),
    "index-of-another-length": Fault(
        "seq_len",
        lambda a, c: a.update(index=st.BlockIndex.full(c.batch, c.kv_heads, c.seq_len + 1, c.block_q, c.block_k)),
        lambda c: replace(c, query_blocks="none"),
    ),
    "num_splits=0": Fault("kernel_options.num_splits", _option(num_splits=0), option=True),
    "num_splits=65": Fault("kernel_options.num_splits", _option(num_splits=65), option=True),
    "fwd_num_warps=32": Fault("kernel_options.fwd_num_warps", _option(fwd_num_warps=32), option=True),
    "dq_num_warps=0": Fault("kernel_options.dq_num_warps", _option(dq_num_warps=0), option=True),
    "fwd_num_stages=9": Fault("kernel_options.fwd_num_stages", _option(fwd_num_stages=9), option=True),
    "kv_num_stages=0": Fault("kernel_options.kv_num_stages", _option(kv_num_stages=0), option=True),
    "dq_heads_per_program=3": Fault(
        "kernel_options.dq_heads_per_program", _option(dq_heads_per_program=3), option=True
    ),
    "fwd_heads_per_program-not-dividing-the-group": Fault(
        "kernel_options.fwd_heads_per_program",
        lambda a, c: a["options"].update(fwd_heads_per_program=_heads_not_dividing(a, c)),
        option=True,
    ),
    "kv_heads_per_program-not-dividing-the-group": Fault(
        "kernel_options.kv_heads_per_program",
        lambda a, c: a["options"].update(kv_heads_per_program=_heads_not_dividing(a, c)),
        option=True,
    ),
    "kv_chunk=0": Fault("kernel_options.kv_chunk", _option(kv_chunk=0), option=True),
    "kv_tile_rows=8": Fault("kernel_options.kv_tile_rows", _option(kv_tile_rows=8), option=True),
    "kv_tile_rows-past-the-tile": Fault(
        "kernel_options.kv_tile_rows",
        lambda a, c: a["options"].update(
            kv_tile_rows=max(32, 2 * a["options"].get("kv_heads_per_program", 1) * c.block_q)
        ),
        option=True,
    ),
    "r0=-1": Fault("kernel_options.r0", _option(r0=-1), option=True),
    "fused_dq-with-stored_ds": Fault("kernel_options.fused_dq", _option(fused_dq=True, stored_ds=True), option=True),
    "fused_dq-with-deterministic": Fault(
        "kernel_options.fused_dq",
        _option(fused_dq=True),
        lambda c: replace(c, deterministic=True, options=tuple(i for i in c.options if i[0] != "stored_ds")),
        option=True,
    ),
    "plan-of-another-index": Fault(
        "plan",
        lambda a, c: a["options"].update(plan=st.BlockIndex.full(c.batch, c.kv_heads, c.seq_len + 1, 16, 16).plan()),
        option=True,
    ),
    "plan-with-another-r0": Fault("r0", lambda a, c: a["options"].update(plan=a["index"].plan(3), r0=4), option=True),
    "plan-with-query_blocks": Fault(
        "kernel_options.plan",
        lambda a, c: a["options"].update(plan=a["index"].plan(a["options"].get("r0"))),
        lambda c: c if c.query_blocks != "none" else replace(c, query_blocks="first"),
        option=True,
    ),
    "unknown-option": Fault("kernel_options has no key 'num_split'", _option(num_split=2)),
}


def fault_message(call: AttentionCall, fault: Fault, form: str) -> str:
    """The ValueError message of the call with the fault, its kernel_options in ``form``."""
    built = build_attention_call(call)
    q, k, v = (t.to(torch.float64 if call.backend == "reference" else KERNEL_DTYPE) for t in built.clean)
    q_local = q if built.rows is None else q[:, :, built.rows]
    args = dict(built.kwargs, q=q_local, q_full=q, k=k, v=v, index=built.index, options=dict(built.options))
    fault.apply(args, call)
    options = args.pop("options")
    del args["q_full"]

    def run():
        kernel_options = (st.KernelOptions(**options) if form == "typed" else options) or None
        with grad_mode(call.grad_mode):
            st.sparse_attention(
                args.pop("q"), args.pop("k"), args.pop("v"), args.pop("index"), kernel_options=kernel_options, **args
            )

    return raised(run)


@pytest.mark.parametrize("fault", sorted(ATTENTION_FAULTS))
@settings(max_examples=3)
@given(call=attention_calls())
@example(call=AttentionCall(batch=0, seq_len=1))
@example(call=AttentionCall(backend="triton", batch=0, seq_len=1))
def test_sparse_attention_names_the_argument_past_its_range(call, fault):
    """One argument just past its range, every other drawn valid (any backend, batch, length, grad mode, mask):
    a ValueError naming it, the same message for a typed and a dict kernel_options."""
    spec = ATTENTION_FAULTS[fault]
    call = spec.needs(call) if spec.needs else call
    if not TRITON:
        call = replace(call, backend="reference")
    message = fault_message(call, spec, "dict")
    assert_names(message, spec.label)
    if spec.option:
        assert fault_message(call, spec, "typed") == message


# -------------------------------------------------------------- sparse_attention: grad modes, typed options
def _outputs_in(call: AttentionCall, mode: str, form: str | None = None):
    """o and lse of the call (its kernel_options in ``form``) under the grad mode ``mode``, with inputs that
    require grad; and whether they carry a graph."""
    built = build_attention_call(call)
    dtype = torch.float64 if call.backend == "reference" else KERNEL_DTYPE
    q, k, v = (t.to(dtype).requires_grad_() for t in built.clean)
    q = q if built.rows is None else q[:, :, built.rows]
    kwargs = dict(built.kwargs, return_lse=True)
    torch.manual_seed(call.seed)
    with grad_mode(mode):
        o, lse = st.sparse_attention(
            q, k, v, built.index, kernel_options=_kernel_options(built, form or call.form), **kwargs
        )
    return o, lse, (q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=4)
@given(data=hs.data())
@example(data=None)
def test_sparse_attention_outputs_equal_in_every_grad_mode(backend, data):
    """The same call under enable_grad, no_grad and inference_mode: equal outputs bit for bit; a graph (and
    gradients of every input) under enable_grad only."""
    call = AttentionCall(batch=0, seq_len=1) if data is None else data.draw(attention_calls(backend))
    call = replace(call, backend=backend)
    o, lse, inputs = _outputs_in(call, "enable_grad")
    assert o.requires_grad and o.grad_fn is not None
    grads = torch.autograd.grad(o.sum() + torch.where(torch.isfinite(lse), lse, 0).sum(), inputs)
    assert [g.shape for g in grads] == [t.shape for t in inputs]
    for mode in ("no_grad", "inference_mode"):
        o2, lse2, _ = _outputs_in(call, mode)
        assert not o2.requires_grad and o2.is_inference() == (mode == "inference_mode")
        assert torch.equal(o2, o.detach()) and torch.equal(lse2, lse.detach()), mode


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@settings(max_examples=4)
@given(call=attention_calls("triton"))
@example(call=AttentionCall(backend="triton", batch=0, seq_len=1, options=(("kv_chunk", 1), ("num_splits", 2))))
def test_typed_and_dict_kernel_options_give_the_same_result(call):
    """kernel_options as a KernelOptions and as a dict of the same fields: the same outputs and gradients, bit
    for bit (the invalid values give the same message: test_sparse_attention_names_the_argument_past_its_range)."""
    results = []
    for form in ("typed", "dict"):
        o, lse, inputs = _outputs_in(replace(call, grad_mode="enable_grad"), "enable_grad", form)
        grads = torch.autograd.grad(o.sum() + torch.where(torch.isfinite(lse), lse, 0).sum(), inputs)
        results.append([o, lse, *grads])
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ================================================================================== BlockIndex constructors
CONSTRUCTORS = ("from_selection", "from_dense", "from_csr", "full", "from_canonical")


@dataclass(frozen=True)
class IndexCall:
    """One drawn constructor call; candidates come from ``seed``."""

    constructor: str = "from_selection"
    batch: int = 1
    kv_heads: int = 1
    seq_len: int = 33
    block_q: int = 16
    block_k: int = 16
    topk: int = 2
    window: int = 1
    sinks: int = 1
    capacity: int | None = None
    check: str = "cheap"
    documents: str = "none"  # full only: none | one | each-token | random | top-ids
    seed: int = 0


def _last_blocks(n: int, bq: int, bk: int) -> list[int]:
    """The last causally reachable key block of each query block, computed here (not by the library)."""
    return [(min((i + 1) * bq, n) - 1) // bk for i in range(-(-n // bq))]


def index_arguments(call: IndexCall) -> dict:
    """The keyword arguments of the constructor, and under ``"rows"`` the candidate key blocks of every (b, h, i)
    row before window and sinks (what the oracle merges)."""
    g = torch.Generator().manual_seed(call.seed)
    b, hkv, n, bq, bk = call.batch, call.kv_heads, call.seq_len, call.block_q, call.block_k
    nqb, nkb = -(-n // bq), -(-n // bk)
    geometry = dict(seq_len=n, block_q=bq, block_k=bk)
    sel = random_selection(b, hkv, n, bq, bk, call.topk, generator=g, distinct=False, drop=0.3)
    if call.constructor == "from_selection" and call.check == "none" and sel.numel():
        # a trusted caller's candidates out of range or past the causal limit are dropped
        junk = torch.tensor([-7, nkb, nkb + 5, 2**40])
        sel = torch.where(torch.rand(sel.shape, generator=g) < 0.2, junk[torch.randint(4, sel.shape, generator=g)], sel)
    rows = sel.tolist()
    if call.constructor == "from_selection":
        return dict(
            selected=sel,
            window=call.window,
            sinks=call.sinks,
            capacity=call.capacity,
            check=call.check,
            rows=rows,
            **geometry,
        )
    if call.constructor == "from_dense":
        causal = (sel >= 0) & (sel <= torch.tensor(_last_blocks(n, bq, bk)).view(1, 1, -1, 1))
        mask = torch.zeros(b, hkv, nqb, nkb + 1, dtype=torch.bool)
        mask = mask.scatter_(-1, torch.where(causal, sel, nkb), True)[..., :nkb]
        return dict(
            mask=mask,
            capacity=call.capacity,
            rows=[[[torch.nonzero(r).view(-1).tolist() for r in m] for m in mb] for mb in mask],
            **geometry,
        )
    if call.constructor == "from_csr":
        lists = [[c for c in row if c >= 0] for mb in rows for m in mb for row in m]
        indptr = torch.tensor([0] + [len(r) for r in lists]).cumsum(0)
        cols = torch.tensor([c for r in lists for c in r], dtype=torch.int32)
        return dict(
            indptr=indptr,
            col_indices=cols,
            batch=b,
            num_kv_heads=hkv,
            window=call.window,
            sinks=call.sinks,
            capacity=call.capacity,
            rows=rows,
            **geometry,
        )
    if call.constructor == "full":
        documents = _document_ids(call.documents, b, n, g)
        return dict(batch=b, num_kv_heads=hkv, document_ids=documents, check=call.check, rows=None, **geometry)
    source = st.BlockIndex.from_selection(
        sel.clamp(min=-1) if call.check != "none" else sel,
        window=call.window,
        sinks=call.sinks,
        check="none",
        **geometry,
    )
    return dict(indices=source.indices, counts=source.counts, check=call.check, rows=rows, **geometry)


def expected_rows(call: IndexCall, arguments: dict) -> list:
    """The sorted key blocks of every (b, h, i) row, by plain Python: the candidates inside [0, last_i], the
    window (the ``window`` blocks ending at last_i), the sinks (blocks 0 .. sinks - 1 up to last_i); for ``full``
    every causal block sharing a document with the query block."""
    n, bq, bk = call.seq_len, call.block_q, call.block_k
    last = _last_blocks(n, bq, bk)
    window = call.window if call.constructor in ("from_selection", "from_csr", "from_canonical") else 0
    sinks = call.sinks if call.constructor in ("from_selection", "from_csr", "from_canonical") else 0
    out = []
    for bi in range(call.batch):
        per_head = []
        for h in range(call.kv_heads):
            per_row = []
            for i, li in enumerate(last):
                if call.constructor == "full":
                    docs = arguments["document_ids"]
                    chosen = set(range(li + 1))
                    if docs is not None:
                        row = docs[bi].tolist()
                        q_docs = (row[i * bq], row[min((i + 1) * bq, n) - 1])
                        chosen = {
                            j for j in chosen if row[j * bk] <= q_docs[1] and row[min((j + 1) * bk, n) - 1] >= q_docs[0]
                        }
                else:
                    chosen = {c for c in arguments["rows"][bi][h][i] if 0 <= c <= li}
                    chosen |= set(range(max(0, li - window + 1), li + 1)) if window else set()
                    chosen |= set(range(min(sinks, li + 1)))
                per_row.append(sorted(chosen))
            per_head.append(per_row)
        out.append(per_head)
    return out


def check_index_call(call: IndexCall) -> None:
    arguments = index_arguments(call)
    rows = arguments.pop("rows")
    want = expected_rows(call, dict(arguments, rows=rows))
    nkb = -(-call.seq_len // call.block_k)
    longest = max((len(r) for mb in want for m in mb for r in m), default=0)
    if call.constructor == "full":
        capacity = nkb
    elif call.constructor == "from_canonical":
        capacity = arguments["indices"].shape[-1]
    elif call.capacity is None:
        capacity = min(1 << max(0, longest - 1).bit_length(), max(1, nkb))
    else:
        capacity = min(call.capacity, nkb)
    trusted = call.check == "none" and call.constructor == "from_selection"  # from_dense and from_csr check
    if capacity < longest and not trusted:
        assert_names(raised(lambda: getattr(st.BlockIndex, call.constructor)(**arguments)), f"capacity={capacity}")
        return
    index = getattr(st.BlockIndex, call.constructor)(**arguments)
    index.validate()
    assert index.indices.shape == (call.batch, call.kv_heads, -(-call.seq_len // call.block_q), capacity)
    got = index.indices.tolist()
    counts = index.counts.tolist()
    for bi, mb in enumerate(want):
        for h, m in enumerate(mb):
            for i, row in enumerate(m):
                row = row[:capacity]  # a trusted caller's longer row keeps its lowest blocks
                assert counts[bi][h][i] == len(row), (bi, h, i)
                assert got[bi][h][i] == row + [-1] * (capacity - len(row)), (bi, h, i)
    if call.constructor == "from_selection" and call.capacity is not None and TRITON:
        # the canonical-merge kernel (what CUDA candidates take), through the interpreter on the CPU
        from sparse_train.kernels.triton.canonical import triton_canonical_merge

        merged = triton_canonical_merge(
            arguments["selected"].to(DEV),
            seq_len=call.seq_len,
            block_q=call.block_q,
            block_k=call.block_k,
            window=call.window,
            sinks=call.sinks,
            capacity=capacity,
        )
        assert torch.equal(merged[0].cpu(), index.indices) and torch.equal(merged[1].cpu(), index.counts)


@hs.composite
def index_calls(draw):
    constructor = draw(hs.sampled_from(CONSTRUCTORS))
    blocks = hs.sampled_from((1, 16, 32, 128, BIG))
    block_q, block_k = draw(blocks), draw(blocks)
    seq_len = draw(hs.sampled_from((1, 2, block_q, block_q + 1, 48)) | hs.integers(1, 48))
    return IndexCall(
        constructor=constructor,
        batch=draw(hs.sampled_from((0, 1, 2))),
        kv_heads=draw(hs.sampled_from((1, 2))),
        seq_len=min(seq_len, 48),
        block_q=block_q,
        block_k=block_k,
        topk=draw(hs.integers(0, 4)),
        window=draw(hs.sampled_from((0, 1, 2, BIG))),
        sinks=draw(hs.sampled_from((0, 1, BIG))),
        capacity=draw(hs.sampled_from((None, 1, 2, BIG))),
        check=draw(hs.sampled_from(("none", "cheap", "full"))),
        documents=draw(hs.sampled_from(("none", "one", "each-token", "random", "top-ids"))),
        seed=draw(hs.integers(0, 2**31 - 1)),
    )


@settings(max_examples=60)
@given(call=index_calls())
@example(call=IndexCall(batch=0, seq_len=1))
@example(call=IndexCall(batch=0, seq_len=1, capacity=1))
@example(call=IndexCall(batch=2, seq_len=1, capacity=1))
@example(call=IndexCall(constructor="full", batch=0, seq_len=1, documents="random"))
@example(call=IndexCall(constructor="from_csr", batch=0, seq_len=48, capacity=BIG))
@example(call=IndexCall(batch=2, seq_len=1, window=BIG, sinks=BIG, capacity=BIG, check="none"))
@example(call=IndexCall(batch=1, seq_len=48, block_q=1, block_k=1, topk=4, window=2, sinks=2, capacity=1, check="none"))
def test_block_index_constructors_match_the_plain_block_sets(call):
    """Every constructor at the ends of its ranges (B = 0, N = 1, blocks of 1 and past N, window and sinks past
    the row, capacity 1 and past NKB, each check level, trusted junk candidates) builds the block sets computed
    here; a capacity below the longest row raises naming it, except for a trusted caller (check="none"), whose
    rows keep their lowest blocks."""
    check_index_call(call)


@dataclass(frozen=True)
class IndexFault:
    """One argument just past its range for ``constructors``; ``apply(args, call)`` rewrites the constructor's
    keyword arguments; ``checked``: an error only when values are checked (``check`` not "none", B >= 1)."""

    label: str
    constructors: tuple
    apply: object
    checked: bool = False


def _candidate(value):
    def apply(args, call):
        nqb = -(-call.seq_len // call.block_q)
        sel = torch.full((call.batch, call.kv_heads, nqb, 1), -1, dtype=torch.int64)
        sel[0, 0, 0, 0] = value(call)
        args["selected"] = sel

    return apply


def _first_row_past_causal(call):
    return _last_blocks(call.seq_len, call.block_q, call.block_k)[0] + 1


WITH_GEOMETRY = CONSTRUCTORS
INDEX_FAULTS = {
    "seq_len=0": IndexFault("seq_len", WITH_GEOMETRY, lambda a, c: a.update(seq_len=0)),
    "block_q=0": IndexFault("block_q", WITH_GEOMETRY, lambda a, c: a.update(block_q=0)),
    "block_k=0": IndexFault("block_k", WITH_GEOMETRY, lambda a, c: a.update(block_k=0)),
    "block_q=16.0": IndexFault("block_q", WITH_GEOMETRY, lambda a, c: a.update(block_q=16.0)),
    "window=-1": IndexFault("window", ("from_selection", "from_csr"), lambda a, c: a.update(window=-1)),
    "sinks=-1": IndexFault("sinks", ("from_selection", "from_csr"), lambda a, c: a.update(sinks=-1)),
    "capacity=0": IndexFault(
        "capacity", ("from_selection", "from_dense", "from_csr"), lambda a, c: a.update(capacity=0)
    ),
    "check=x": IndexFault("check", ("from_selection", "full", "from_canonical"), lambda a, c: a.update(check="x")),
    "candidate=-2": IndexFault("candidate key block -2", ("from_selection",), _candidate(lambda c: -2), True),
    "candidate=NKB": IndexFault(
        "out of range", ("from_selection",), _candidate(lambda c: -(-c.seq_len // c.block_k)), True
    ),
    "candidate-past-the-causal-limit": IndexFault(
        "candidate key block", ("from_selection",), _candidate(_first_row_past_causal), True
    ),
    "selected-float": IndexFault(
        "selected", ("from_selection",), lambda a, c: a.update(selected=a["selected"].double())
    ),
    "selected-of-another-NQB": IndexFault(
        "selected", ("from_selection",), lambda a, c: a.update(selected=torch.zeros(1, 1, 1000, 1, dtype=torch.int64))
    ),
    "batch=-1": IndexFault("batch", ("full", "from_csr"), lambda a, c: a.update(batch=-1)),
    "num_kv_heads=0": IndexFault("num_kv_heads", ("full", "from_csr"), lambda a, c: a.update(num_kv_heads=0)),
    "mask-not-bool": IndexFault("mask", ("from_dense",), lambda a, c: a.update(mask=a["mask"].int())),
    "mask-of-another-shape": IndexFault("mask", ("from_dense",), lambda a, c: a.update(mask=a["mask"][..., :0])),
    "indptr-of-another-length": IndexFault("indptr", ("from_csr",), lambda a, c: a.update(indptr=a["indptr"][:-1])),
    "col_indices-float": IndexFault(
        "col_indices", ("from_csr",), lambda a, c: a.update(col_indices=a["col_indices"].float())
    ),
    "counts-past-the-capacity": IndexFault(
        "invalid block index",
        ("from_canonical",),
        lambda a, c: a.update(counts=a["counts"] + a["indices"].shape[-1] + 1),
        True,
    ),
    "indices-a-list": IndexFault("indices", ("from_canonical",), lambda a, c: a.update(indices=a["indices"].tolist())),
    "indices-int64": IndexFault("indices", ("from_canonical",), lambda a, c: a.update(indices=a["indices"].long())),
    "document_ids-decreasing": IndexFault(
        "document_ids", ("full",), lambda a, c: a.update(document_ids=_decreasing_ids(c)), True
    ),
    "document_ids-of-another-shape": IndexFault(
        "document_ids",
        ("full",),
        lambda a, c: a.update(document_ids=torch.zeros(c.batch + 1, c.seq_len, dtype=torch.int64)),
    ),
}


def _decreasing_ids(call):
    ids = torch.zeros(call.batch, call.seq_len, dtype=torch.int64)
    ids[:, 0] = 1
    return ids


@pytest.mark.parametrize("fault", sorted(INDEX_FAULTS))
@settings(max_examples=3)
@given(call=index_calls())
@example(call=IndexCall(batch=0, seq_len=1))
def test_block_index_constructors_name_the_argument_past_its_range(call, fault):
    """One constructor argument just past its range (the others drawn valid, B = 0 and N = 1 among them; value
    faults with B >= 1 and checks on): a ValueError naming it."""
    spec = INDEX_FAULTS[fault]
    if call.constructor not in spec.constructors:
        call = replace(call, constructor=spec.constructors[0])
    if spec.checked:
        call = replace(call, batch=max(call.batch, 1), seq_len=max(call.seq_len, 2), check="full")
    if fault == "candidate-past-the-causal-limit" and _first_row_past_causal(call) >= -(-call.seq_len // call.block_k):
        call = replace(call, seq_len=48, block_q=16, block_k=16)  # query block 0 then has blocks past its reach
    arguments = index_arguments(call)
    arguments.pop("rows")
    spec.apply(arguments, call)
    assert_names(raised(lambda: getattr(st.BlockIndex, call.constructor)(**arguments)), spec.label)


# ============================================================================ SparseAttention and its config
# selector: the pooled scorer where a draw leaves it out (any block size); the draws take the token selector too
MODULE_BASE = dict(
    block_q=16, block_k=16, top_k=1, window=1, sinks=1, selector="pooled", selector_dim=8, dense_warmup_steps=0
)
LARGEST = 1.7976931348623157e308


def config_ends(kernel: bool) -> dict:
    """Valid values of each SparseAttentionConfig field at the ends of its documented range (the Triton kernels
    take blocks of 16 to 128; a block of 1 and one past N run on the reference). ``"block_q"`` as a value of
    distill_query_rows stands for the config's block_q; ``densities`` is the (exit, enter) pair. The factors without
    an upper bound (scale, distill_weight) stop at values whose products stay finite in float64: at the largest
    float their logits or loss overflow to inf, as any product there would."""
    blocks = (16, 32) if kernel else (1, 16, 32, 128)
    return {
        "block_q": blocks,
        "block_k": blocks,
        "top_k": (0, 1, BIG),
        "window": (0, 1, BIG),
        "sinks": (0, 1, BIG),
        "top_p": (None, TINY, 0.5, 1.0),
        "selector": ("pooled", "pooled", "token", "oracle"),
        "selector_dim": (1, 8),
        "selector_index_heads": (1, 2),
        "selector_distill": ("block", "token"),
        "selector_candidates": (None, 1, BIG, "auto"),
        "selector_rope_style": ("rotate_half", "interleaved"),
        "key_pooling": ("mean", "mean_max"),
        "query_pooling": ("mean", "mean_max"),
        "selector_rope_theta": (None, 1e-30, 1e4, LARGEST),
        "selector_distance_bias": (False, True),
        "selector_lr_multiplier": (2.0**-100, 1.0, 2.0**100),
        "dense_warmup_steps": (0, 1, BIG),
        "dropout_p": (0.0, 0.5, JUST_BELOW_ONE),
        "scale": (None, TINY, 0.25, 4.0),
        "deterministic": (False, True),
        "kernel_options": (
            None,
            {"r0": 0, "kv_chunk": 1},
            st.KernelOptions(num_splits=2, kv_chunk=1),
            {"stored_ds": True},
            {"fused_dq": True},
        ),
        "distill": ("sparse", "sampled", "dense", "off"),
        "distill_row_pool": ("max", "mean"),
        "distill_support": ("dynamic", "causal"),
        "distill_weight": (0.0, 1.0, 1e6),
        "distill_every": (1, 2, BIG),
        "distill_query_rows": (None, 1, "block_q"),
        "distill_query_blocks": (1, BIG),
        "distill_chunk_mb": (1, BIG),
        "replay": (False, True),
        "dense_fallback": (False, True),
        "densities": ((0.0, 0.0), (0.8, 0.9), (1.0, 1.0), (0.0, 1.0)),
        "index_check": ("none", "cheap", "full"),
        "metrics_every": (0, 1, BIG),
        "metrics_query_blocks": (1, BIG),
        "profile": (False, True),
    }


def config_fields(backend: str, fields: dict) -> dict:
    """The SparseAttentionConfig keyword arguments of drawn ``fields`` over :data:`MODULE_BASE`, made one valid
    config: top_k + window + sinks kept > 0, ``"block_q"`` rows resolved, blocks of 16 or more for the token
    selector, no fused_dq with deterministic, the densities pair split."""
    fields = dict(MODULE_BASE, backend=backend, **fields)
    if fields["top_k"] + fields["window"] + fields["sinks"] == 0:
        fields["window"] = 1
    if fields.get("distill_query_rows") == "block_q":
        fields["distill_query_rows"] = fields["block_q"]
    if isinstance(fields.get("selector_candidates"), int):
        # candidates score only for the token selector trained at token level, and at least top_k of them
        fields.update(selector="token", selector_distill="token")
        fields["selector_candidates"] = max(fields["selector_candidates"], fields["top_k"])
        if fields.get("distill") in ("sparse", "dense"):
            fields["distill"] = "sampled"
    if fields.get("selector") == "token":
        fields["block_q"], fields["block_k"] = max(fields["block_q"], 16), max(fields["block_k"], 16)
    if fields.get("deterministic") and isinstance(fields.get("kernel_options"), dict):
        fields["kernel_options"] = {k: v for k, v in fields["kernel_options"].items() if k != "fused_dq"}
    if "densities" in fields:
        fields["dense_exit_density"], fields["dense_enter_density"] = fields.pop("densities")
    return fields


def module_config(backend: str, fields: dict) -> st.SparseAttentionConfig:
    return st.SparseAttentionConfig(**config_fields(backend, fields))


@dataclass(frozen=True)
class ModuleCall:
    """One drawn SparseAttention forward: its config (``fields`` over :data:`MODULE_BASE`), shapes, masks, mode."""

    backend: str = "reference"
    fields: tuple = ()
    batch: int = 1
    kv_heads: int = 2
    group: int = 2
    seq_len: int = 40
    seq_lens: str = "none"
    documents: str = "none"
    positions: bool = False
    training: bool = True
    grad_mode: str = "enable_grad"
    call_scale: float | None = None
    call_dropout_p: float | None = None
    seed: int = 0


@hs.composite
def module_calls(draw, backend: str | None = None):
    backend = backend or draw(hs.sampled_from(("reference", "triton")))
    kernel = backend == "triton"
    ends = config_ends(kernel)
    fields = draw(hs.fixed_dictionaries({}, optional={name: hs.sampled_from(values) for name, values in ends.items()}))
    max_len = 40 if kernel else 48
    return ModuleCall(
        backend=backend,
        fields=tuple(sorted(fields.items(), key=lambda item: item[0])),
        batch=draw(hs.sampled_from((0, 1, 2))),
        kv_heads=1 if kernel else draw(hs.sampled_from((1, 2))),
        group=draw(hs.sampled_from((1, 2))),
        seq_len=draw(hs.sampled_from((1, 16, 17, max_len)) | hs.integers(1, max_len)),
        seq_lens=draw(hs.sampled_from(("none", "none", "zeros", "full", "random"))),
        documents=draw(hs.sampled_from(("none", "none", "one", "each-token", "random"))),
        positions=draw(hs.booleans()),
        training=draw(hs.booleans()),
        grad_mode=draw(hs.sampled_from(GRAD_MODES)),
        call_scale=draw(hs.sampled_from((None, None, 0.5))),
        call_dropout_p=draw(hs.sampled_from((None, None, 0.0, 0.5))),
        seed=draw(hs.integers(0, 2**31 - 1)),
    )


@dataclass
class BuiltModuleCall:
    module: st.SparseAttention
    clean: list  # float64 q, k, v
    kwargs: dict  # seq_lens, document_ids, position_ids, scale, dropout_p


def build_module_call(call: ModuleCall, dtype) -> BuiltModuleCall:
    config = module_config(call.backend, dict(call.fields))
    torch.manual_seed(call.seed)
    hq, hkv, d = call.kv_heads * call.group, call.kv_heads, 16
    module = st.SparseAttention(config, num_heads=hq, num_kv_heads=hkv, head_dim=d).to(DEV).train(call.training)
    with torch.no_grad():  # a trained selector, not the initialisation (which scores every block alike)
        for p in module.scorer.parameters():
            p.add_(0.3 * torch.randn_like(p) / float(getattr(module.scorer, "lr_multiplier", 1.0)))
    g = torch.Generator().manual_seed(call.seed)
    b, n = call.batch, call.seq_len
    clean = make_qkv(b, hq, hkv, n, d, torch.float64, generator=g, device=DEV)
    seq_lens = {
        "none": None,
        "zeros": torch.zeros(b, dtype=torch.int64),
        "full": torch.full((b,), n, dtype=torch.int64),
        "random": torch.randint(0, n + 1, (b,), generator=g),
    }[call.seq_lens]
    documents = _document_ids(call.documents, b, n, g)
    kwargs = dict(
        seq_lens=None if seq_lens is None else seq_lens.to(DEV),
        document_ids=None if documents is None else documents.to(DEV),
        position_ids=torch.arange(n, device=DEV).expand(b, n) if call.positions else None,
        scale=call.call_scale,
        dropout_p=call.call_dropout_p,
    )
    return BuiltModuleCall(module.to(dtype), clean, kwargs)


def check_module_call(call: ModuleCall) -> None:
    """The module's output against the float64 oracle on the index it attended (its selection, or the full
    causal index on its dense paths), with the mode's dropout and the call's scale; the input gradients of
    ``sum(o * w) + selector_loss`` are those of ``sum(o * w)`` alone (the selector loss reaches the selector
    only), and the selector's gradients and loss are finite."""
    dtype = torch.float64 if call.backend == "reference" else KERNEL_DTYPE
    built = build_module_call(call, dtype)
    module, cfg = built.module, built.module.config
    inputs = [t.to(dtype).detach().requires_grad_() for t in built.clean]
    torch.manual_seed(call.seed)
    with grad_mode(call.grad_mode):
        o = module(*inputs, **built.kwargs)
    assert o.shape == inputs[0].shape and o.dtype == dtype
    p = (cfg.dropout_p if call.call_dropout_p is None else call.call_dropout_p) if call.training else 0.0
    seed = None
    if p > 0:
        torch.manual_seed(call.seed)
        seed = draw_dropout_seed()
    scale = call.call_scale or cfg.scale or 1 / math.sqrt(16)
    index = module.last_selection
    if index is None:  # a dense path: every causal block (of the query block's documents)
        index = st.BlockIndex.full(call.batch, call.kv_heads, call.seq_len, cfg.block_q, cfg.block_k, device=DEV)
    docs, lens = built.kwargs["document_ids"], built.kwargs["seq_lens"]
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(call.seed + 1), dtype=torch.float64).to(DEV)

    def oracle(q, k, v):
        return dense_oracle(q, k, v, index, lens, p, seed, scale=scale, document_ids=docs)[0], torch.zeros(q.shape[:3])

    zero = torch.zeros(o.shape[:3], dtype=torch.float64, device=DEV)
    want = outputs_and_grads(lambda q, k, v: (oracle(q, k, v)[0], zero), *built.clean, w, zero)
    enabled = call.grad_mode == "enable_grad"
    if enabled:
        loss = (o.double() * w).sum() + (module.selector_loss if module.selector_loss is not None else 0)
        got = [o, *torch.autograd.grad(loss, inputs, allow_unused=True)]
        if module.selector_loss is not None:
            assert torch.isfinite(module.selector_loss) and module.selector_loss >= -1e-6
            module.selector_loss.backward()
            for name, param in module.scorer.named_parameters():
                assert param.grad is None or torch.isfinite(param.grad).all(), name
    else:
        assert not o.requires_grad and module.selector_loss is None
        got = [o]
    lowp = None
    if dtype != torch.float64:
        lowp = outputs_and_grads(
            lambda q, k, v: (
                reference_sparse_attention(
                    q,
                    k,
                    v,
                    index,
                    scale=scale,
                    dropout_p=p,
                    dropout_seed=seed,
                    seq_lens=lens,
                    document_ids=docs,
                    upcast=False,
                )[0],
                zero,
            ),
            *inputs,
            w,
            zero,
        )
    for name, a, i in zip(("o", "dq", "dk", "dv"), got, (0, 2, 3, 4)):
        assert a is not None and not torch.isnan(a).any(), name
        if lowp is None:
            torch.testing.assert_close(a, want[i], rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
        else:
            check_kernel(name, a, want[i], lowp[i].to(a.dtype), dtype)
    stats = module.stats()
    assert all(isinstance(value, float) for value in stats.values())


MODULE_EXAMPLES = [
    pytest.param(ModuleCall(batch=0, seq_len=1), id="B0-N1"),
    pytest.param(ModuleCall(batch=0, seq_len=40, seq_lens="zeros", documents="random"), id="B0-every-mask"),
    pytest.param(ModuleCall(batch=2, seq_len=1, fields=(("dense_fallback", False),)), id="N1-sparse-path"),
    pytest.param(ModuleCall(seq_len=16, fields=(("scale", TINY),)), id="dense-path-scale-0-in-float32"),
    pytest.param(
        ModuleCall(
            batch=2,
            seq_len=40,
            fields=(("dense_fallback", False), ("distill", "sparse"), ("dropout_p", 0.5), ("top_p", TINY)),
            seq_lens="random",
            documents="random",
            positions=True,
        ),
        id="sparse-path-every-mask-dropout",
    ),
    pytest.param(
        ModuleCall(seq_len=40, fields=(("dense_warmup_steps", BIG), ("dropout_p", 0.5), ("metrics_every", 1))),
        id="dense-warmup-dropout-metrics",
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=16)
@given(data=hs.data())
def test_sparse_attention_module_matches_the_oracle_at_the_config_ends(backend, data):
    """Every SparseAttentionConfig field drawn at the ends of its range (see :func:`config_ends`), train or eval, in
    a drawn grad mode, with the forward's masks and overrides: the output and input gradients against the float64
    oracle on the index the module attended (:func:`check_module_call`)."""
    check_module_call(data.draw(module_calls(backend)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call", MODULE_EXAMPLES)
def test_sparse_attention_module_matches_the_oracle_on_the_explicit_ends(backend, call):
    check_module_call(replace(call, backend=backend))


def _selector_grads(module) -> list:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.scorer.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [pytest.param(True, id="train"), pytest.param(False, id="eval")])
@settings(max_examples=3)
@given(data=hs.data())
@example(data=None)
def test_sparse_attention_module_outputs_equal_in_every_grad_mode(backend, training, data):
    """One module state and input under enable_grad, no_grad and inference_mode (train and eval): equal outputs bit
    for bit; a graph, input gradients and (training, distilling) a selector loss with selector gradients under
    enable_grad only."""
    call = ModuleCall(batch=0, seq_len=1) if data is None else data.draw(module_calls(backend))
    call = replace(call, backend=backend, training=training)
    dtype = torch.float64 if backend == "reference" else KERNEL_DTYPE
    built = build_module_call(call, dtype)
    outputs = {}
    for mode in GRAD_MODES:
        module = copy.deepcopy(built.module)
        inputs = [t.to(dtype).requires_grad_() for t in built.clean]
        torch.manual_seed(call.seed)
        with grad_mode(mode):
            o = module(*inputs, **built.kwargs)
        if mode == "enable_grad":
            assert o.requires_grad
            loss = o.sum() + (module.selector_loss if module.selector_loss is not None else 0)
            loss.backward()
            assert all(t.grad is not None and t.grad.shape == t.shape for t in inputs)
            distills = training and module.config.distill != "off" and module.config.selector != "oracle"
            assert (module.selector_loss is not None) == distills  # the first training call distills
        else:
            assert not o.requires_grad and o.is_inference() == (mode == "inference_mode")
            assert module.selector_loss is None
            assert all(p.grad is None for p in module.scorer.parameters())
        outputs[mode] = o.detach()
    for mode in ("no_grad", "inference_mode"):
        assert torch.equal(outputs[mode], outputs["enable_grad"]), mode


# --------------------------------------------------------------------- SparseAttention and config: past the ends
CONFIG_PAST_ENDS = {
    # id: (what the message names, the fields past their range)
    "block_q=0": ("SparseAttentionConfig.block_q", {"block_q": 0}),
    "block_k=0": ("SparseAttentionConfig.block_k", {"block_k": 0}),
    "top_k=-1": ("SparseAttentionConfig.top_k", {"top_k": -1}),
    "window=-1": ("SparseAttentionConfig.window", {"window": -1}),
    "sinks=-1": ("SparseAttentionConfig.sinks", {"sinks": -1}),
    "top_k+window+sinks=0": ("top_k + window + sinks", {"top_k": 0, "window": 0, "sinks": 0}),
    "top_p=0": ("SparseAttentionConfig.top_p", {"top_p": 0.0}),
    "top_p-past-1": ("SparseAttentionConfig.top_p", {"top_p": math.nextafter(1.0, 2.0)}),
    "selector_dim=0": ("SparseAttentionConfig.selector_dim", {"selector_dim": 0}),
    "selector_index_heads=0": ("SparseAttentionConfig.selector_index_heads", {"selector_index_heads": 0}),
    "selector_candidates=0": ("SparseAttentionConfig.selector_candidates", {"selector_candidates": 0}),
    "selector_lr_multiplier-below-2**-100": (
        "SparseAttentionConfig.selector_lr_multiplier",
        {"selector_lr_multiplier": math.nextafter(2.0**-100, 0.0)},
    ),
    "selector_lr_multiplier-past-2**100": (
        "SparseAttentionConfig.selector_lr_multiplier",
        {"selector_lr_multiplier": math.nextafter(2.0**100, math.inf)},
    ),
    "selector_rope_theta=0": ("SparseAttentionConfig.selector_rope_theta", {"selector_rope_theta": 0.0}),
    "dense_warmup_steps=-1": ("SparseAttentionConfig.dense_warmup_steps", {"dense_warmup_steps": -1}),
    "dropout_p=1": ("SparseAttentionConfig.dropout_p", {"dropout_p": 1.0}),
    "dropout_p=-tiny": ("SparseAttentionConfig.dropout_p", {"dropout_p": -TINY}),
    "scale=0": ("SparseAttentionConfig.scale", {"scale": 0.0}),
    "distill_weight=-tiny": ("SparseAttentionConfig.distill_weight", {"distill_weight": -TINY}),
    "distill_every=0": ("SparseAttentionConfig.distill_every", {"distill_every": 0}),
    "distill_query_rows=0": ("SparseAttentionConfig.distill_query_rows", {"distill_query_rows": 0}),
    "distill_query_rows-past-block_q": (
        "SparseAttentionConfig.distill_query_rows",
        {"distill_query_rows": "past-block_q"},
    ),
    "distill_query_blocks=0": ("SparseAttentionConfig.distill_query_blocks", {"distill_query_blocks": 0}),
    "distill_chunk_mb=0": ("SparseAttentionConfig.distill_chunk_mb", {"distill_chunk_mb": 0}),
    "dense_enter_density-past-1": (
        "SparseAttentionConfig.dense_enter_density",
        {"dense_enter_density": math.nextafter(1.0, 2.0)},
    ),
    "dense_exit_density=-tiny": ("SparseAttentionConfig.dense_exit_density", {"dense_exit_density": -TINY}),
    "dense_exit_density-past-enter": (
        "dense_exit_density <= dense_enter_density",
        {"dense_exit_density": 0.5, "dense_enter_density": 0.4},
    ),
    "metrics_every=-1": ("SparseAttentionConfig.metrics_every", {"metrics_every": -1}),
    "metrics_query_blocks=0": ("SparseAttentionConfig.metrics_query_blocks", {"metrics_query_blocks": 0}),
    "kernel_options.num_splits=65": ("kernel_options.num_splits", {"kernel_options": {"num_splits": 65}}),
}


@pytest.mark.parametrize("fault", sorted(CONFIG_PAST_ENDS))
@settings(max_examples=3)
@given(fields=hs.fixed_dictionaries({}, optional={k: hs.sampled_from(v) for k, v in config_ends(False).items()}))
def test_config_names_the_field_past_its_range(fault, fields):
    """One field just past its range, the others drawn at their valid ends: a ValueError naming the field (the
    single values are pinned by tests/test_config_validation.py; this draws them among every other field's ends)."""
    kwargs = config_fields("reference", fields)
    label, changes = CONFIG_PAST_ENDS[fault]
    if changes.get("distill_query_rows") == "past-block_q":
        changes = dict(changes, distill_query_rows=kwargs["block_q"] + 1)
    kwargs.update(changes)
    assert_names(raised(lambda: st.SparseAttentionConfig(**kwargs)), label)


def _module_args(call: ModuleCall):
    config = module_config(call.backend, dict(call.fields))
    return config, call.kv_heads * call.group, call.kv_heads, 16


MODULE_FAULTS = {
    # (label, what it changes: constructor arguments or the forward's)
    "config-a-dict": ("config must be a SparseAttentionConfig", lambda c, h, kv, d, a: ({}, h, kv, d, a)),
    "num_heads=0": ("num_heads", lambda c, h, kv, d, a: (c, 0, kv, d, a)),
    "num_heads-not-a-multiple": ("num_kv_heads", lambda c, h, kv, d, a: (c, 2 * h + 1, 2, d, a)),
    "head_dim=0": ("head_dim", lambda c, h, kv, d, a: (c, h, kv, 0, a)),
    "kernel_options-past-the-group": (
        "kernel_options.kv_heads_per_program",
        lambda c, h, kv, d, a: (replace(c, kernel_options=st.KernelOptions(kv_heads_per_program=2 * h)), h, kv, d, a),
    ),
    "selector_rope_theta-too-small-for-float32": (
        "SparseAttentionConfig.selector_rope_theta",
        lambda c, h, kv, d, a: (replace(c, selector_rope_theta=TINY), h, kv, d, a),
    ),
    "token-selector-block-1": (
        "block_q",
        lambda c, h, kv, d, a: (replace(c, selector="token", block_q=1, block_k=16), h, kv, d, a),
    ),
    "N=0": ("sequence length N", lambda c, h, kv, d, a: (c, h, kv, d, dict(a, n=0))),
    "scale=0": ("scale", lambda c, h, kv, d, a: (c, h, kv, d, dict(a, scale=0.0))),
    "scale=nan": ("scale", lambda c, h, kv, d, a: (c, h, kv, d, dict(a, scale=math.nan))),
    "dropout_p=1": ("dropout_p", lambda c, h, kv, d, a: (c, h, kv, d, dict(a, dropout_p=1.0))),
    "seq_lens=N+1": ("seq_lens", lambda c, h, kv, d, a: (c, h, kv, d, dict(a, seq_lens="N+1"))),
    "document_ids-decreasing": (
        "document_ids",
        lambda c, h, kv, d, a: (c, h, kv, d, dict(a, document_ids="decreasing")),
    ),
    "position_ids-of-another-length": (
        "position_ids",
        lambda c, h, kv, d, a: (c, h, kv, d, dict(a, position_ids="long")),
    ),
    "q-of-other-heads": ("num_heads", lambda c, h, kv, d, a: (c, h, kv, d, dict(a, heads=h + kv))),
}


@pytest.mark.parametrize("fault", sorted(MODULE_FAULTS))
@settings(max_examples=3)
@given(call=module_calls("reference"))
@example(call=ModuleCall(batch=0, seq_len=1))
def test_sparse_attention_module_names_the_argument_past_its_range(fault, call):
    """A constructor or forward argument just past its range, the config and input drawn valid: a ValueError
    naming it, in the drawn grad mode and train or eval mode."""
    label, change = MODULE_FAULTS[fault]
    call = replace(call, batch=max(call.batch, 1), seq_len=max(call.seq_len, 2))
    g = torch.Generator().manual_seed(call.seed)

    def run():
        config, heads, kv_heads, head_dim, args = change(*_module_args(call), {})
        n = args.get("n", call.seq_len)
        module = st.SparseAttention(config, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim).double()
        q, k, v = make_qkv(call.batch, args.get("heads", heads), kv_heads, n, head_dim, torch.float64, generator=g)
        kwargs = {name: args[name] for name in ("scale", "dropout_p") if name in args}
        if args.get("seq_lens") == "N+1":
            kwargs["seq_lens"] = torch.full((call.batch,), n + 1)
        if args.get("document_ids") == "decreasing":
            kwargs["document_ids"] = torch.zeros(call.batch, n, dtype=torch.int64).index_fill_(1, torch.tensor([0]), 1)
        if args.get("position_ids") == "long":
            kwargs["position_ids"] = torch.arange(n + 1)
        with grad_mode(call.grad_mode):
            module.train(call.training)(q, k, v, **kwargs)

    assert_names(raised(run), label)


# ================================================================================ activation checkpointing
FLAVOURS = {
    "non-reentrant": lambda run, *xs: checkpoint(run, *xs, use_reentrant=False),
    "reentrant": lambda run, *xs: checkpoint(run, *xs, use_reentrant=True),
    "selective": lambda run, *xs: checkpoint(run, *xs, use_reentrant=False, context_fn=st.keep_attention_context),
    "keeping-attention": st.checkpoint_keeping_attention,
}


@hs.composite
def checkpoint_calls(draw, backend: str):
    """A training forward of a module whose selector trains: every distillation target, the sparse, warm-up and
    full-selection paths, dropout, masks, B = 0 and N = 1."""
    fields = {
        "distill": draw(hs.sampled_from(("sampled", "sparse", "dense", "off"))),
        "dense_warmup_steps": draw(hs.sampled_from((0, 0, 1, BIG))),
        "dense_fallback": draw(hs.booleans()),
        "dropout_p": draw(hs.sampled_from((0.0, 0.3))),
        "top_p": draw(hs.sampled_from((None, 0.5))),
        "distill_query_blocks": 2,
    }
    return ModuleCall(
        backend=backend,
        fields=tuple(sorted(fields.items())),
        batch=draw(hs.sampled_from((0, 1, 2))),
        kv_heads=1,
        group=2,
        seq_len=draw(hs.sampled_from((1, 33, 40))),
        seq_lens=draw(hs.sampled_from(("none", "random"))),
        documents=draw(hs.sampled_from(("none", "random"))),
        seed=draw(hs.integers(0, 2**31 - 1)),
    )


def checkpointed_step(call: ModuleCall, flavour: str | None):
    """Output, input gradients and selector gradients of one training step ``sum(layer(q, k, v) * w)`` plus the
    selector losses, the layer a projection around the module, plain (``flavour`` None) or checkpointed."""
    dtype = torch.float64 if call.backend == "reference" else KERNEL_DTYPE
    built = build_module_call(call, dtype)
    module = built.module
    inputs = [t.to(dtype).requires_grad_() for t in built.clean]
    w = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(call.seed + 1)).to(DEV, dtype)

    def layer(q, k, v):  # ops before and after the core give the checkpointed region tensors of its own
        return module(q * 1.5, torch.tanh(k), v, **built.kwargs).sin()

    torch.manual_seed(call.seed)  # the dropout seed is drawn from the global generator
    out = layer(*inputs) if flavour is None else FLAVOURS[flavour](layer, *inputs)
    ((out * w).sum() + st.collect_selector_losses(module)).backward()
    return [out.detach(), *(t.grad for t in inputs), *_selector_grads(module)]


CHECKPOINT_EXAMPLES = [
    ModuleCall(batch=0, seq_len=1, fields=(("dense_fallback", False),)),
    ModuleCall(batch=2, seq_len=1, kv_heads=1, fields=(("distill", "sparse"),)),
    ModuleCall(
        batch=2,
        seq_len=40,
        kv_heads=1,
        seq_lens="random",
        documents="random",
        fields=(("dense_fallback", False), ("distill", "sparse"), ("dropout_p", 0.3)),
    ),
]


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@settings(max_examples=3)
@given(call=checkpoint_calls("reference"))
@example(call=CHECKPOINT_EXAMPLES[0])
@example(call=CHECKPOINT_EXAMPLES[1])
@example(call=CHECKPOINT_EXAMPLES[2])
def test_checkpointed_module_equals_the_plain_step(flavour, call):
    """torch.utils.checkpoint non-reentrant, reentrant, selective (context_fn=keep_attention_context) and
    checkpoint_keeping_attention around a training SparseAttention whose selector trains: output, input gradients
    and selector gradients equal the un-checkpointed step's, in float64 (the replay tests of
    tests/module/test_checkpoint_replay.py change the selector between forward and backward)."""
    plain = checkpointed_step(call, None)
    for name, a, b in zip(("o", "dq", "dk", "dv", *("selector",) * 8), checkpointed_step(call, flavour), plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("flavour", ["selective", "reentrant"])
@pytest.mark.parametrize("call", CHECKPOINT_EXAMPLES[1:], ids=["N1", "sparse-path-every-mask-dropout"])
def test_checkpointed_module_on_the_kernels_equals_the_plain_step(flavour, call):
    """The same on the Triton kernels (the selective policy keeps their forward op's outputs): bit for bit."""
    plain = checkpointed_step(replace(call, backend="triton"), None)
    for a, b in zip(checkpointed_step(replace(call, backend="triton"), flavour), plain):
        assert torch.equal(a, b)


def _tiny_llama(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def _hf_checkpointing(model, kwargs: dict) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


HF_FLAVOURS = {
    "non-reentrant": {"use_reentrant": False},
    "reentrant": {"use_reentrant": True},
    "selective": {"use_reentrant": False, "context_fn": st.keep_attention_context},
}
HF_SPARSE = dict(block_q=16, block_k=16, top_k=1, window=1, sinks=1, selector_dim=8, dense_warmup_steps=0)


@functools.cache
def _hf_plain_step(distill: str):
    return _hf_step(None, distill)


def _hf_step(flavour: str | None, distill: str):
    from sparse_train.integrations import hf

    model = _tiny_llama()
    hf.enable(model, st.SparseAttentionConfig(**HF_SPARSE, distill=distill, dense_fallback=False))
    model.train()
    if flavour is not None:
        _hf_checkpointing(model, HF_FLAVOURS[flavour])
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(5))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=embeds, labels=ids)
    (out.loss + st.collect_selector_losses(model)).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if "sparse_attention" in name}
    assert grads and all(g is not None for g in grads.values())
    return out.logits.detach(), embeds.grad, grads


@pytest.mark.parametrize("flavour", sorted(HF_FLAVOURS))
@pytest.mark.parametrize("distill", ["sampled", "sparse"])
def test_hf_gradient_checkpointing_equals_the_plain_step(flavour, distill):
    """Hugging Face gradient checkpointing of a tiny Llama (use_reentrant True and False, and selective): logits,
    the input embeddings' gradient and every selector's gradients equal the un-checkpointed step's (the model's
    parameter gradients over two optimizer steps: tests/module/test_checkpoint_replay.py)."""
    logits, dx, grads = _hf_step(flavour, distill)
    want_logits, want_dx, want_grads = _hf_plain_step(distill)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, want_dx, rtol=1e-10, atol=1e-12)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


# ==================================================================================== enable_context_parallel
def _cp_model(kind: str):
    """A model of the given kind for enable_context_parallel."""
    if kind == "not-a-module":
        return "model"
    if kind == "no-sparse-module":
        return torch.nn.Linear(2, 2)
    selector = {
        "pooled-module": "pooled",
        "nested-pooled": "pooled",
        "token-module": "token",
        "oracle-module": "oracle",
    }[kind]
    module = st.SparseAttention(
        st.SparseAttentionConfig(**{**MODULE_BASE, "selector": selector}, backend="reference"),
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ).double()
    return torch.nn.Sequential(torch.nn.Identity(), module) if kind == "nested-pooled" else module


CP_MODELS = ("not-a-module", "no-sparse-module", "pooled-module", "nested-pooled", "token-module", "oracle-module")
CP_BACKENDS = (None, "auto", "reference", "triton", "cuda", "Reference", 3)


def _cp_expected(model_kind: str, backend, group_kind: str, initialised: bool) -> str | None:
    """The label the error must name, in the order enable_context_parallel checks (None: it succeeds)."""
    if model_kind == "not-a-module":
        return "model must be a torch.nn.Module"
    if backend not in (None, "auto", "reference", "triton"):
        return "backend must be None or one of"
    if model_kind == "oracle-module":
        return "not the oracle selector"
    if not initialised:
        return "initialised torch.distributed process group"
    if group_kind == "not-a-group":
        return "group must be a torch.distributed ProcessGroup"
    if model_kind == "no-sparse-module":
        return "no module that supports context parallelism"
    return None


@settings(max_examples=25)
@given(model_kind=hs.sampled_from(CP_MODELS), backend=hs.sampled_from(CP_BACKENDS))
def test_enable_context_parallel_without_a_process_group_names_the_problem(model_kind, backend):
    """Single process, no process group: every call raises a ValueError naming its first bad argument, and
    returns at once (no collective is started)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    label = _cp_expected(model_kind, backend, "default", initialised=False)
    assert_names(raised(lambda: st.enable_context_parallel(_cp_model(model_kind), backend=backend)), label)


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone (no other process is started), removed after the test."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@settings(max_examples=25, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@given(
    model_kind=hs.sampled_from(CP_MODELS),
    backend=hs.sampled_from(CP_BACKENDS),
    group_kind=hs.sampled_from(("default", "world", "not-a-group")),
    seq_len=hs.sampled_from((32, 64)),
)
@example(model_kind="pooled-module", backend="reference", group_kind="world", seq_len=32)
def test_enable_context_parallel_in_a_world_of_one(world_of_one, model_kind, backend, group_kind, seq_len):
    """With a process group of one: a bad argument raises naming it; a valid call switches every SparseAttention,
    whose forward over the whole sequence (the one rank's shard) equals the module without context parallelism."""
    model = _cp_model(model_kind)
    group = {"default": None, "world": world_of_one, "not-a-group": 3}[group_kind]
    label = _cp_expected(model_kind, backend, group_kind, initialised=True)
    if label is not None:
        assert_names(raised(lambda: st.enable_context_parallel(model, group, backend=backend)), label)
        return
    if backend == "triton":
        backend = "reference"  # float64 inputs: the kernels are tested against the reference elsewhere
    plain = copy.deepcopy(model)
    assert st.enable_context_parallel(model, group, backend=backend) == 1
    core, plain_core = (model[1], plain[1]) if model_kind == "nested-pooled" else (model, plain)
    q, k, v = make_qkv(2, 4, 2, seq_len, 16, torch.float64, seed=seq_len)
    try:
        torch.testing.assert_close(core(q, k, v), plain_core(q, k, v), rtol=1e-12, atol=1e-12)
    finally:
        st.disable_context_parallel(model)


# ================================================================================================ hf.enable
HF_MODELS = (
    "llama",
    "llama-base-model",
    "decoder-layer",
    "config-without-heads",
    "no-attention-layers",
    "linear",
    "none",
)
HF_CONFIGS = ("none", "valid", "dict", "kernel-options", "heads-past-the-group")


def _hf_model(kind: str):
    if kind in ("linear", "none"):
        return torch.nn.Linear(2, 2) if kind == "linear" else None
    model = _tiny_llama(layers=1)
    if kind == "llama-base-model":
        return model.model
    if kind == "decoder-layer":
        return model.model.layers[0]
    holder = torch.nn.Module()
    holder.config = object() if kind == "config-without-heads" else model.config
    holder.mlp = torch.nn.Linear(2, 2)
    return model if kind == "llama" else holder


def _hf_config(kind: str):
    return {
        "none": None,
        "valid": st.SparseAttentionConfig(**dict(HF_SPARSE, top_k=64)),
        "dict": dict(HF_SPARSE),
        "kernel-options": st.KernelOptions(),
        "heads-past-the-group": st.SparseAttentionConfig(**HF_SPARSE, kernel_options={"fwd_heads_per_program": 4}),
    }[kind]


@settings(max_examples=20)
@given(model_kind=hs.sampled_from(HF_MODELS), config_kind=hs.sampled_from(HF_CONFIGS))
@example(model_kind="llama", config_kind="valid")
def test_hf_enable_names_a_bad_model_or_config(model_kind, config_kind):
    """hf.enable with each kind of model and config: a ValueError naming the config (not a SparseAttentionConfig,
    or kernel options that do not fit the model's heads) or the model (not a Hugging Face model, no attention
    layers); a valid pair switches every attention layer, and with every block selected the logits equal the
    model's own SDPA logits."""
    from sparse_train.integrations import hf

    model, config = _hf_model(model_kind), _hf_config(config_kind)
    if config_kind in ("dict", "kernel-options"):
        label = "hf.enable: config must be a SparseAttentionConfig"
    elif model_kind in ("decoder-layer", "config-without-heads", "linear", "none"):
        label = "hf.enable: model must be a Hugging Face transformers model"
    elif model_kind == "no-attention-layers":
        label = "found no attention layers"
    elif config_kind == "heads-past-the-group":
        label = "kernel_options.fwd_heads_per_program"
    else:
        label = None
    if label is not None:
        assert_names(raised(lambda: hf.enable(model, config)), label)
        return
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        want = model(ids)
        assert hf.enable(model, config) is model
        got = model(ids)
    layers = hf.attention_layers(model)
    assert layers and all(isinstance(layer.sparse_attention, st.SparseAttention) for layer in layers)
    if model_kind == "llama" and config_kind == "valid":
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-10, atol=1e-10)
    hf.disable(model)
