"""Activation checkpointing that keeps the attention (``sparse_train.module.checkpointing``): the recompute in the
backward reruns the layer's other ops but takes the attention outputs of the first forward, and every
gradient is bitwise the one of plain checkpointing and of no checkpointing."""

import contextlib

import pytest
import torch

import sparse_train as st
import sparse_train.kernels.triton.op as kernel_op
from sparse_train.lightning.model import Transformer, TransformerConfig
from sparse_train.module.checkpointing import attention_ops, checkpoint_keeping_attention

SPARSE = dict(
    block_q=16,
    block_k=16,
    top_k=2,
    window=1,
    sinks=1,
    backend="triton",
    dense_warmup_steps=0,
    dense_fallback=False,
    distill="sampled",
)


def train_step(attention, checkpointing, keep, monkeypatch, device="cpu", seq_len=96):
    """Loss, parameter gradients and the number of kernel forwards of one step of a 2-layer model (on the CPU
    fp32 with the Triton kernels through the interpreter; on CUDA under bf16 autocast)."""
    launches = []
    forward = kernel_op.sparse_attn_forward

    def counted(*args, **kwargs):
        launches.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(kernel_op, "sparse_attn_forward", counted)
    cfg = TransformerConfig(
        vocab_size=61,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        attention=attention,
        sparse=SPARSE,
        activation_checkpointing=checkpointing,
        checkpoint_keeps_attention=keep,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).train()
    torch.manual_seed(1)
    tokens, labels = (torch.randint(61, (1, seq_len)).to(device) for _ in range(2))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = model(tokens, labels=labels)
        loss = out.loss_sum / out.count
        if attention == "sparse":
            loss = loss + st.collect_selector_losses(model)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(launches)


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_kept_attention_gives_the_gradients_of_plain_checkpointing(attention, monkeypatch):
    loss, grads, plain_launches = train_step(attention, False, False, monkeypatch)
    for keep in (False, True):
        got_loss, got_grads, launches = train_step(attention, True, keep, monkeypatch)
        assert torch.equal(got_loss, loss)
        assert got_grads.keys() == grads.keys()
        for name in grads:
            assert torch.equal(got_grads[name], grads[name]), (keep, name)
        if attention == "sparse":
            # one kernel forward per layer, plus one more per layer when the recompute reruns the attention
            assert plain_launches == 2 and launches == (2 if keep else 4), (keep, launches)
    if attention == "sparse":
        assert any(name.endswith("query_proj") for name in grads), "the selector must receive a gradient"


@pytest.mark.gpu
def test_kept_attention_on_gpu_gives_the_gradients_of_plain_checkpointing(monkeypatch):
    """The same on the GPU (bf16 autocast, compiled kernels): the sparse kernels are deterministic, so the two
    policies are bitwise equal. (Not the dense core here: SDPA's fused backward may sum dQ in another order
    from run to run, which would test SDPA, not the policy.)"""
    _, grads, _ = train_step("sparse", True, False, monkeypatch, device="cuda", seq_len=2048)
    _, got, launches = train_step("sparse", True, True, monkeypatch, device="cuda", seq_len=2048)
    assert launches == 2
    for name in grads:
        assert torch.equal(got[name], grads[name]), name


def test_kept_ops_are_the_sparse_kernel_and_the_fused_sdpa_kernels():
    names = {str(op) for op in attention_ops()}
    assert "sparse_train.sparse_attn_fwd.default" in names
    assert "aten._scaled_dot_product_flash_attention.default" in names


def test_checkpoint_keeping_attention_passes_keyword_arguments_and_equals_plain():
    """The helper around a plain function: same values and input gradients as no checkpointing."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))

    def layer(q, k, v, *, gain):
        o = torch.nn.functional.scaled_dot_product_attention(q.sin(), k, v, is_causal=True)
        return (o * gain).tanh()

    want = layer(q, k, v, gain=2.0)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    got = checkpoint_keeping_attention(layer, q, k, v, gain=2.0)
    got_grads = torch.autograd.grad(got.sum(), (q, k, v))
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("attention", ["sparse", "dense"])
def test_hf_gradient_checkpointing_keeping_attention_equals_plain(attention, monkeypatch):
    """A Hugging Face model (tiny Llama; the sparse core through the Triton interpreter, the dense one through
    SDPA) with gradient checkpointing keeping the attention: the gradients of plain checkpointing, and the
    sparse kernel's forward runs once per layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparse_train.integrations import hf
    from sparse_train.module.checkpointing import checkpoint_kwargs

    def grads(keep):
        launches = []
        forward = kernel_op.sparse_attn_forward
        monkeypatch.setattr(kernel_op, "sparse_attn_forward", lambda *a, **k: launches.append(1) or forward(*a, **k))
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        model = LlamaForCausalLM(config)
        if attention == "sparse":
            hf.enable(model, st.SparseAttentionConfig(**{**SPARSE, "distill": "sparse"}))
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(keep))
        ids = torch.randint(0, 97, (1, 96), generator=torch.Generator().manual_seed(3))
        loss = model(ids, labels=ids).loss
        if attention == "sparse":
            loss = loss + st.collect_selector_losses(model)
        loss.backward()
        monkeypatch.setattr(kernel_op, "sparse_attn_forward", forward)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(launches)

    want, plain_launches = grads(False)
    got, launches = grads(True)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    if attention == "sparse":
        assert (plain_launches, launches) == (4, 2)


def record_policy_ops(monkeypatch, exclude_host_ops: bool) -> list:
    """Names of the ops selective checkpointing's policy is asked about in one training step of the sparse
    2-layer model with the attention kept (the policy decides in the first forward; the recompute follows
    what it stored)."""
    import sparse_train.module.attention as attention_module
    import sparse_train.module.checkpointing as checkpointing

    seen = []
    keep = checkpointing._keep_attention

    def recording(ctx, op, *args, **kwargs):
        seen.append(str(op))
        return keep(ctx, op, *args, **kwargs)

    monkeypatch.setattr(checkpointing, "_keep_attention", recording)
    if not exclude_host_ops:
        monkeypatch.setattr(attention_module, "outside_selective_checkpoint", contextlib.nullcontext)
    _, grads, _ = train_step("sparse", True, True, monkeypatch)
    return seen, grads


def test_selection_plan_and_distillation_run_outside_the_checkpoint_mode(monkeypatch):
    """The selector's top-k, the plan's sort and the distillation's ops never reach the policy (they run outside
    selective checkpointing's dispatch mode, for host time), the kept attention kernel still does (once per
    layer), and the gradients are the same either way."""
    seen, grads = record_policy_ops(monkeypatch, exclude_host_ops=True)
    assert seen.count("sparse_train.sparse_attn_fwd.default") == 2, seen
    assert not any(name.startswith(("aten.topk", "aten.sort", "aten.argsort")) for name in seen), seen
    monkeypatch.undo()
    seen_all, grads_all = record_policy_ops(monkeypatch, exclude_host_ops=False)
    assert any(name.startswith(("aten.topk", "aten.sort", "aten.argsort")) for name in seen_all)
    print(f"ops the policy is asked about: {len(seen)} outside, {len(seen_all)} without the exclusion")
    assert len(seen) < len(seen_all)
    for name in grads:
        assert torch.equal(grads[name], grads_all[name]), name


def test_outside_selective_checkpoint_leaves_other_modes_alone():
    """Under any dispatch mode that is not selective checkpointing's, nothing is taken off."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparse_train.module.checkpointing import outside_selective_checkpoint

    class Counting(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        with outside_selective_checkpoint() as taken_off:
            torch.ones(3).add(1)
    assert not taken_off and Counting.calls >= 2
    with outside_selective_checkpoint() as taken_off:
        assert not taken_off
