"""The chunked linear cross-entropy (``sparse_train.losses``) against the plain path: the head's full logits
and ``F.cross_entropy``."""

import pytest
import torch
import torch.nn.functional as F
from builders import check_close

from sparse_train.losses import _checkpointed_chunks, linear_cross_entropy


def plain(hidden, weight, labels, ignore_index=-100):
    """The path the chunked loss replaces: every logit at once."""
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    correct = ((logits.argmax(-1) == labels) & (labels != ignore_index)).sum()
    return loss, correct


def problem(rows, width, vocab, dtype, seed, ignored=0.3):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, width, generator=gen, dtype=torch.float64) / width**0.5).to(dtype).requires_grad_()
    labels = torch.randint(vocab, (rows,), generator=gen)
    labels[torch.rand(rows, generator=gen) < ignored] = -100
    return hidden, weight, labels


def loss_and_grads(fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    loss, correct = fn(hidden, weight, labels)
    (2.5 * loss).backward()  # a scaled loss: the backward must scale the gradients made in the forward
    return loss.detach(), correct, hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 3, 7, 13, 100], ids=["chunk1", "chunk3", "chunk7", "chunk-exact", "one-chunk"])
def test_matches_plain_cross_entropy_in_float64(chunk):
    hidden, weight, labels = problem(13, 8, 11, torch.float64, seed=chunk)
    got = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=chunk), hidden, weight, labels)
    want = loss_and_grads(plain, hidden, weight, labels)
    for name, g, r in zip(("loss", "correct", "d hidden", "d weight"), got, want):
        print(f"{name}: max abs err {(g.double() - r.double()).abs().max().item():.2e}")
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-12, atol=1e-12)
    assert int(got[1]) == int(want[1])


@pytest.mark.parametrize("chunk", [1, 7, 13, 100], ids=["chunk1", "chunk7", "chunk-exact", "one-chunk"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float64", "autocast-bf16"])
def test_compile_path_equals_the_eager_path(chunk, autocast):
    """The path ``linear_cross_entropy`` takes while ``torch.compile`` traces (checkpointed plain chunks; the
    autograd function is not traceable, module docstring), run eagerly here so that it is tested on every
    torch version: the same loss, count and gradients as the eager path."""
    hidden, weight, labels = problem(40, 16, 50, torch.float64, seed=chunk)
    ref = loss_and_grads(plain, hidden, weight, labels)
    if autocast:
        hidden, weight = (t.detach().float().requires_grad_() for t in (hidden, weight))
    compute = torch.bfloat16 if autocast else torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = loss_and_grads(
            lambda h, w, y: _checkpointed_chunks(h, w, y, chunk, -100, compute), hidden, weight, labels
        )
        want = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=chunk), hidden, weight, labels)
    assert int(got[1]) == int(want[1])
    for i, name in [(0, "loss"), (2, "d hidden"), (3, "d weight")]:
        assert got[i].dtype == want[i].dtype, name
        if autocast:  # the loss scale reaches the bf16 logit gradient before its rounding here, after it there
            check_close(f"{name} autocast bf16", got[i].double(), ref[i], want[i].double(), torch.bfloat16)
        else:
            torch.testing.assert_close(got[i], want[i], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_error_within_the_plain_paths(dtype):
    """In bf16/fp16 both paths round the logits the same way; the chunked one sums the head's gradient in
    float32. Error ratio against the float64 computation, as for the kernels."""
    hidden, weight, labels = problem(50, 32, 97, torch.float64, seed=4)
    ref = loss_and_grads(plain, hidden, weight, labels)
    low = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight)]
    got = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=16), *low, labels)
    ref_lowp = loss_and_grads(plain, *low, labels)
    for i, name in [(0, "loss"), (2, "d hidden"), (3, "d weight")]:
        check_close(f"{name} {dtype}", got[i].double(), ref[i], ref_lowp[i].double(), dtype)


def test_under_autocast_error_within_the_plain_paths():
    """float32 weights and hidden under bf16 autocast (the recipes' bf16-mixed): both paths take the logits
    from a bf16 matmul; gradients come back in float32, and their error against float64 is the plain path's."""
    hidden, weight, labels = problem(40, 16, 50, torch.float64, seed=2)
    ref = loss_and_grads(plain, hidden, weight, labels)
    low = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=9), *low, labels)
        ref_lowp = loss_and_grads(plain, *low, labels)
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    assert int(got[1]) == int(ref_lowp[1])
    for i, name in [(0, "loss"), (2, "d hidden"), (3, "d weight")]:
        check_close(f"{name} autocast bf16", got[i].double(), ref[i], ref_lowp[i].double(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,chunk", [(8192 + 37, 4096), (1000, 8192)], ids=["three-chunks", "one-chunk"])
def test_cuda_autocast_error_within_the_plain_paths(rows, chunk):
    """On the GPU (cuBLAS bf16 logits, the recipes' bf16-mixed): loss and gradients of the chunked head,
    errors against float64 within the plain path's, and the same correct count."""
    hidden, weight, labels = problem(rows, 256, 32000, torch.float64, seed=5)
    hidden, weight = (t.detach().cuda().requires_grad_() for t in (hidden, weight))
    labels = labels.cuda()
    ref = loss_and_grads(plain, hidden, weight, labels)
    low = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = loss_and_grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=chunk), *low, labels)
        ref_lowp = loss_and_grads(plain, *low, labels)
    assert int(got[1]) == int(ref_lowp[1])
    for i, name in [(0, "loss"), (2, "d hidden"), (3, "d weight")]:
        check_close(f"{name} cuda autocast bf16", got[i].double(), ref[i], ref_lowp[i].double(), torch.bfloat16)


def test_no_labelled_row_gives_zero_loss_and_zero_gradients():
    hidden, weight, labels = problem(6, 4, 5, torch.float64, seed=1, ignored=1.1)
    loss, correct, dh, dw = loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=4), hidden, weight, labels
    )
    assert loss.item() == 0.0 and int(correct) == 0
    assert torch.count_nonzero(dh) == 0 and torch.count_nonzero(dw) == 0


def test_without_grad_computes_no_gradients():
    hidden, weight, labels = problem(9, 4, 5, torch.float64, seed=3)
    with torch.no_grad():
        loss, correct = linear_cross_entropy(hidden, weight, labels, chunk_tokens=2)
    want, want_correct = plain(hidden.detach(), weight.detach(), labels)
    torch.testing.assert_close(loss.double(), want, rtol=1e-12, atol=1e-12)
    assert int(correct) == int(want_correct) and not loss.requires_grad


@pytest.mark.parametrize(
    "args,match",
    [
        pytest.param(dict(hidden=torch.zeros(3, 4, 2)), "hidden must be a floating-point", id="hidden-3d"),
        pytest.param(
            dict(hidden=torch.zeros(3, 4, dtype=torch.int64)), "hidden must be a floating-point", id="hidden-int"
        ),
        pytest.param(dict(weight=torch.zeros(5, 3)), r"weight must be a floating-point \[V, d=4\]", id="weight-width"),
        pytest.param(dict(labels=torch.zeros(2, dtype=torch.int64)), r"labels must be \[T=3\]", id="labels-length"),
        pytest.param(dict(labels=torch.zeros(3)), "labels must have an integer dtype", id="labels-float"),
        pytest.param(dict(chunk_tokens=0), "chunk_tokens", id="chunk-zero"),
    ],
)
def test_rejects_bad_arguments(args, match):
    call = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), labels=torch.zeros(3, dtype=torch.int64))
    call.update(args)
    chunk = call.pop("chunk_tokens", 2)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(call["hidden"], call["weight"], call["labels"], chunk_tokens=chunk)


SPARSE = dict(
    selector="pooled",  # 8-token blocks
    block_q=8,
    block_k=8,
    top_k=2,
    window=1,
    sinks=1,
    backend="reference",
    dense_warmup_steps=0,
    dense_fallback=False,
    distill="off",
)


@pytest.mark.parametrize(
    "attention,checkpointing",
    [
        pytest.param("dense", False, id="dense"),
        pytest.param("sparse", False, id="sparse"),
        pytest.param("sparse", True, id="sparse-activation-checkpointing"),
    ],
)
def test_transformer_labels_path_equals_logits_path(attention, checkpointing):
    """``Transformer(tokens, labels=...)`` (the training loss, chunked, logits never whole) gives the loss,
    correct count and every parameter gradient of cross-entropy over the full logits, in float64."""
    from sparse_train.lightning.model import Transformer, TransformerConfig

    cfg = TransformerConfig(
        vocab_size=61,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        attention=attention,
        sparse=SPARSE,
        activation_checkpointing=checkpointing,
        loss_chunk_tokens=7,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).double().train()
    tokens = torch.randint(61, (2, 48))
    labels = torch.randint(61, (2, 48))
    labels[0, :10] = -100
    labels[1, 30:] = -100

    out = model(tokens, labels=labels)
    (3.0 * out.loss_sum).backward()
    got = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = model(tokens).reshape(-1, 61)
    want_loss = F.cross_entropy(logits, labels.reshape(-1), reduction="sum")
    (3.0 * want_loss).backward()
    assert int(out.count) == int((labels != -100).sum())
    assert int(out.correct) == int(((logits.argmax(-1) == labels.reshape(-1)) & (labels.reshape(-1) != -100)).sum())
    torch.testing.assert_close(out.loss_sum, want_loss, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        if p.grad is None:  # the selector, without distillation, gets no gradient on either path
            assert got[name] is None, name
            continue
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_transformer_rejects_labels_of_another_shape():
    from sparse_train.lightning.model import Transformer, TransformerConfig

    model = Transformer(
        TransformerConfig(vocab_size=61, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, attention="dense")
    )
    with pytest.raises(ValueError, match=r"labels must have the tokens' shape \(2, 16\)"):
        model(torch.zeros(2, 16, dtype=torch.int64), labels=torch.zeros(2, 15, dtype=torch.int64))
