"""Our Transformer with packed documents: a packed row computes what each document alone computes (RoPE
positions restart per document, attention stays inside the document), for the sparse core (full and
partial selections), the dense twin and activation checkpointing."""

import pytest
import torch
from builders import ids_from_lengths

from sparse_train.lightning import Transformer, TransformerConfig

TINY = dict(vocab_size=70, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
SPARSE = dict(
    block_q=16, block_k=16, top_k=2, window=1, sinks=1, backend="reference", dense_warmup_steps=0, distill="off"
)


def each_document_alone(model, tokens, lengths_per_row):
    rows = []
    for b, lengths in enumerate(lengths_per_row):
        parts, start = [], 0
        for n in lengths:
            parts.append(model(tokens[b : b + 1, start : start + n]))
            start += n
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def build(attention, checkpointing=False, **sparse):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        **TINY,
        attention=attention,
        sparse=dict(SPARSE, **sparse) if attention == "sparse" else {},
        activation_checkpointing=checkpointing,
    )
    return Transformer(cfg).double()


CASES = [
    pytest.param("dense", {}, [[37, 2, 61], [100]], id="dense-twin-unaligned"),
    pytest.param("sparse", dict(top_k=16, dense_fallback=False), [[37, 2, 61], [100]], id="sparse-full-unaligned"),
    pytest.param("sparse", dict(top_k=16), [[37, 2, 61], [9, 91]], id="sparse-dense-fallback"),
    # documents on block boundaries: each document's selection is the one it gets alone
    pytest.param("sparse", dict(dense_fallback=False), [[96, 64], [48, 112]], id="sparse-partial-aligned"),
]


@pytest.mark.parametrize("attention,sparse,lengths", CASES)
def test_packed_row_equals_each_document_alone(attention, sparse, lengths):
    model = build(attention, **sparse)
    model.eval()
    n = sum(lengths[0])
    tokens = torch.randint(70, (2, n), generator=torch.Generator().manual_seed(1))
    ids = ids_from_lengths(*lengths)
    with torch.no_grad():
        packed = model(tokens, document_ids=ids)
        alone = each_document_alone(model, tokens, lengths)
        torch.testing.assert_close(packed, alone)
        assert not torch.allclose(model(tokens), alone)  # without document ids the row mixes documents


def test_packed_training_step_with_activation_checkpointing_matches_plain():
    lengths = [[37, 2, 61]]
    tokens = torch.randint(70, (1, 100), generator=torch.Generator().manual_seed(2))
    ids = ids_from_lengths(*lengths).to(torch.int32)
    grads = []
    for checkpointing in (False, True):
        model = build("sparse", checkpointing, distill="sampled")
        model.train()
        logits = model(tokens, document_ids=ids)
        loss = logits.square().mean() + sum(core.selector_loss for core in model.sparse_cores())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_forward_rejects_bad_document_ids():
    model = build("dense")
    tokens = torch.randint(70, (2, 40))
    with pytest.raises(ValueError, match="document_ids must have shape"):
        model(tokens, document_ids=torch.zeros(1, 40, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-decreasing"):
        model(tokens, document_ids=torch.arange(40).flip(0).expand(2, -1))
