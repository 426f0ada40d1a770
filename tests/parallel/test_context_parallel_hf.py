"""Hugging Face models under context parallelism: tiny Llama / Qwen2 models with ``hf.enable`` and
``enable_context_parallel`` on two CPU processes (gloo, reference backend, float64), each fed its shard by
``hf.context_parallel_inputs``, against one process on the whole batch: logits, the loss (the ranks' losses sum
to it), the selector losses and every parameter gradient (summed over the ranks). Plain rows and rows packed
with documents (global ``position_ids`` restarting), with the pooled and with the token selector; and the refusals
(padding mask, local positions).

The loss that is differentiated is the float64 cross-entropy of the logits against ``shift_labels`` over
``num_items_in_batch`` (transformers' own loss upcasts to float32; it is compared at float32 precision). The
selector scores and distils in float32 whatever the input dtype, so its loss and its parameters' gradients are
compared at float32 precision; everything else at float64 precision.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from builders import ids_from_starts, spawn_ranks, value_errors_of

import sparse_train as st
import sparse_train.parallel.context_parallel as cp

transformers = pytest.importorskip("transformers")
from sparse_train.integrations import hf  # noqa: E402

WORLD = 2
B, N, VOCAB = 2, 64, 61
FP64_TOL = dict(rtol=1e-9, atol=1e-11)
FP32_TOL = dict(rtol=2e-5, atol=2e-6)
SPARSE = dict(
    selector="pooled",  # 8-token blocks; TOKEN below names the token selector's case
    block_q=8,
    block_k=8,
    top_k=2,
    window=1,
    sinks=1,
    backend="reference",
    selector_dim=4,
    distill="dense",
    dense_fallback=False,
    dense_warmup_steps=0,
)
FAMILIES = ["llama", "qwen2"]
# The token selector trained at token level (blocks of its kernels' sizes; top_k 1 of the four blocks, so the
# selection is not every causal block).
TOKEN = dict(
    selector="token",
    selector_distill="token",
    selector_candidates=None,
    distill="sampled",
    block_q=16,
    block_k=16,
    top_k=1,
)
# (id, document starts per row or None, SPARSE overrides)
CASES = [("plain", None, {}), ("packed", [[0, 13, 40], [0, 30]], {}), ("packed_token", [[0, 13, 40], [0, 30]], TOKEN)]


def _model(family: str, sparse=None):
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    model = model_class(config_class(**common)).to(torch.float64)
    hf.enable(model, st.SparseAttentionConfig(**{**SPARSE, **(sparse or {})}))
    with torch.no_grad():  # a trained-looking selector: every term non-zero
        for name, p in model.named_parameters():
            if ".sparse_attention." in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.train()


def _batch(starts):
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (B, N), generator=g)
    labels = ids.clone()
    labels[:, ::5] = -100
    if starts is None:
        return ids, labels, torch.arange(N).view(1, N)
    documents = ids_from_starts(starts, N)  # [B, N] document ids
    first = torch.stack([torch.searchsorted(d, d, right=False) for d in documents])  # each token's document start
    return ids, labels, torch.arange(N).view(1, N) - first


def _shifted(labels):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _run(model, **inputs):
    out = model(**inputs)
    shift_labels = inputs["shift_labels"]
    count = inputs["num_items_in_batch"]
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), shift_labels.flatten(), reduction="sum") / count
    selector = st.collect_selector_losses(model)
    (ce + selector).backward()
    return dict(
        logits=out.logits.detach(),
        loss=ce.detach(),
        hf_loss=out.loss.detach(),
        selector_loss=selector.detach(),
        grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for family in FAMILIES:
        for name, starts, sparse in CASES:
            model = _model(family, sparse)
            cp.enable_context_parallel(model)
            ids, labels, positions = _batch(starts)
            results[family, name] = _run(model, **hf.context_parallel_inputs(ids, labels, positions))
    model = _model("llama")
    cp.enable_context_parallel(model)
    inputs = hf.context_parallel_inputs(*_batch(None))
    local_ids = inputs["input_ids"]
    mask = torch.ones_like(local_ids)
    mask[0, -3:] = 0
    try:
        model(local_ids, attention_mask=mask, position_ids=inputs["position_ids"])
        padding = "no error"
    except NotImplementedError as error:
        padding = str(error)
    results["errors"] = [padding] + value_errors_of(
        [
            lambda: model(local_ids),  # no position_ids: the model would rotate at local positions
            lambda: hf.context_parallel_inputs(torch.zeros(B, 30, dtype=torch.int64)),  # 30 % (2 * 2) != 0
        ]
    )
    dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel_hf")
    spawn_ranks(_worker, WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hf_model_under_cp_equals_one_process(two_ranks, family, case):
    name, starts, sparse = case
    model = _model(family, sparse)
    ids, labels, positions = _batch(starts)
    shift = _shifted(labels)
    want = _run(
        model,
        input_ids=ids,
        labels=labels,
        position_ids=positions,
        shift_labels=shift,
        num_items_in_batch=(shift != -100).sum(),
    )
    got = [ranks[family, name] for ranks in two_ranks]
    for rank, result in enumerate(got):
        torch.testing.assert_close(result["logits"], cp.shard_sequence(want["logits"], 1, rank, WORLD), **FP64_TOL)
    torch.testing.assert_close(sum(r["loss"] for r in got), want["loss"], **FP64_TOL)
    torch.testing.assert_close(sum(r["hf_loss"] for r in got), want["hf_loss"], **FP32_TOL)
    torch.testing.assert_close(want["hf_loss"].double(), want["loss"], **FP32_TOL)
    torch.testing.assert_close(sum(r["selector_loss"] for r in got), want["selector_loss"], **FP32_TOL)
    assert want["selector_loss"] > 0
    assert sorted(got[0]["grads"]) == sorted(want["grads"])
    for pname, grad in want["grads"].items():
        tol = FP32_TOL if ".sparse_attention." in pname else FP64_TOL
        torch.testing.assert_close(sum(r["grads"][pname] for r in got), grad, **tol, msg=pname)


def test_hf_model_under_cp_refusals_name_the_problem(two_ranks):
    errors = two_ranks[0]["errors"]
    assert "takes no padding mask" in errors[0]
    assert "needs position_ids that are this rank's shard of the GLOBAL positions" in errors[1]
    assert "30" in errors[2]
