"""Exact resume of ``SparseAttention`` training from state dicts: the buffers that decide later calls (training-forward
count, distillation draw number, dense/sparse hysteresis, dropout seeds) are in the state dict, state dicts without
them still load (also strictly), and a plain PyTorch loop (AdamW, activation checkpointing) saved after k steps and
continued in a fresh model and optimizer equals the uninterrupted run bitwise: losses, selections, quality metrics,
weights and optimizer state."""

import io

import pytest
import torch
import torch.utils.checkpoint
from builders import make_qkv
from torch import nn

import sparse_train as st
from sparse_train.module.attention import RESUME_STATE

VOCAB, DIM, HQ, HKV, D = 40, 32, 4, 2, 8

# 16-token blocks with 2 learned + 1 window + 1 sink blocks per query block: N = 64 is a full selection, N = 80 a
# selected fraction of 0.93 (the hysteresis enters the dense path at >= 0.9), N = 96 0.86 (between the thresholds:
# the path stays where it is), N = 112 0.79 and N = 128 0.72 (the dense path is left at <= 0.8). Two of the 5 to 8
# query blocks are distilled per step, so the draw number picks which.
SPARSE = dict(
    block_q=16,
    block_k=16,
    top_k=2,
    window=1,
    sinks=1,
    selector_dim=8,
    backend="reference",
    distill="sampled",
    distill_query_blocks=2,
    dense_warmup_steps=2,
    metrics_every=3,
    metrics_query_blocks=2,
)
# Steps 0-1 warm up dense, step 2 enters the dense path by hysteresis, steps 3-5 hold it at 96 tokens (step 5 is
# the first one after the resume), step 6 leaves it, steps 7-9 run sparse.
SEQ_LENS = (64, 64, 80, 96, 96, 96, 112, 128, 96, 128)
SAVED_AFTER = 5


class Layer(nn.Module):
    def __init__(self, config: st.SparseAttentionConfig) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, (HQ + 2 * HKV) * D)
        self.out = nn.Linear(HQ * D, DIM)
        self.core = st.SparseAttention(config, num_heads=HQ, num_kv_heads=HKV, head_dim=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, n, _ = x.shape
        q, k, v = self.qkv(x).view(batch, n, HQ + 2 * HKV, D).transpose(1, 2).split([HQ, HKV, HKV], dim=1)
        o = self.core(q, k, v)
        return x + self.out(o.transpose(1, 2).reshape(batch, n, HQ * D))


class TinyLM(nn.Module):
    def __init__(self, config: st.SparseAttentionConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(config) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)  # the recompute replays
        return self.head(x)


def build(seed: int, dropout_p: float = 0.0) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM(st.SparseAttentionConfig(**SPARSE, dropout_p=dropout_p)).train()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-2)


def train(model: TinyLM, optimizer: torch.optim.Optimizer, steps: range) -> list[dict]:
    """One record per step: the losses, each layer's selection (None on the dense path) and quality metrics."""
    records = []
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)  # the data of step ``step``, resumed or not
        tokens = torch.randint(VOCAB, (2, SEQ_LENS[step] + 1), generator=generator)
        logits = model(tokens[:, :-1])
        lm_loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        selector_loss = st.collect_selector_losses(model)
        optimizer.zero_grad(set_to_none=True)
        (lm_loss + selector_loss).backward()
        optimizer.step()
        cores = [layer.core for layer in model.layers]
        records.append(
            {
                "lm_loss": lm_loss.detach(),
                "selector_losses": [core.selector_loss.detach() for core in cores],
                "selections": [None if core.last_selection is None else core.last_selection.indices for core in cores],
                "quality": [dict(core._last_quality) if step % SPARSE["metrics_every"] == 0 else {} for core in cores],
            }
        )
    return records


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_state_dict_without_the_resume_state_loads_strictly_at_initial_values():
    """A state dict written without ``distill_draws`` / ``dense_mode`` loads under ``strict=True`` with their
    initial values; a state dict without any key of the module still reports all of them missing."""
    config = st.SparseAttentionConfig(**dict(SPARSE, dense_warmup_steps=0))
    q, k, v = make_qkv(1, HQ, HKV, 80, D, requires_grad=True)
    trained = st.SparseAttention(config, num_heads=HQ, num_kv_heads=HKV, head_dim=D).train()
    trained(q, k, v)  # 80 tokens: the hysteresis enters the dense path; the distillation draws once
    assert int(trained.distill_draws) == 1 and bool(trained.dense_mode)
    assert int(trained.dropout_base) == -1 and int(trained.dropout_draws) == 0  # no dropout: nothing drawn
    saved = trained.state_dict()
    old = {key: value for key, value in saved.items() if key not in RESUME_STATE}
    assert old.keys() == saved.keys() - set(RESUME_STATE)
    fresh = st.SparseAttention(config, num_heads=HQ, num_kv_heads=HKV, head_dim=D).train()
    fresh(q, k, v)
    fresh(q, k, v)
    fresh.load_state_dict(old, strict=True)
    assert int(fresh.distill_draws) == 0 and not bool(fresh.dense_mode) and not fresh._dense_mode
    assert int(fresh.selector_steps) == fresh._training_calls == 1
    fresh.load_state_dict(saved, strict=True)
    assert int(fresh.distill_draws) == 1 and bool(fresh.dense_mode) and fresh._dense_mode
    empty = st.SparseAttention(config, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "selector_steps", "distill_draws"'):
        empty.load_state_dict({}, strict=True)


def test_dropout_seeds_continue_from_the_state_dict_and_building_draws_nothing():
    """Building the module leaves torch's global generator alone (a sparse model's weights equal its dense twin's);
    the first call with dropout draws the base from it; the seeds then follow from the base and the draw number,
    which a state dict carries into a module built anywhere, and a state dict without them starts undrawn."""
    config = st.SparseAttentionConfig(**dict(SPARSE, dense_warmup_steps=0, dropout_p=0.3))
    torch.manual_seed(3)
    before = torch.get_rng_state()
    module = st.SparseAttention(config, num_heads=HQ, num_kv_heads=HKV, head_dim=D).train()
    assert torch.equal(torch.get_rng_state(), before)
    seeds = [module._draw_dropout_seed() for _ in range(3)]
    assert len(set(seeds)) == 3 and all(0 <= seed < 2**62 for seed in seeds)
    assert int(module.dropout_draws) == 3 and int(module.dropout_base) >= 0
    saved = {key: value.clone() for key, value in module.state_dict().items()}  # the buffers advance in place
    later = [module._draw_dropout_seed() for _ in range(2)]
    torch.manual_seed(99)  # another global state: the loaded base decides
    fresh = st.SparseAttention(config, num_heads=HQ, num_kv_heads=HKV, head_dim=D).train()
    fresh.load_state_dict(saved, strict=True)
    assert [fresh._draw_dropout_seed() for _ in range(2)] == later
    old = {key: value for key, value in saved.items() if key not in ("dropout_base", "dropout_draws")}
    fresh.load_state_dict(old, strict=True)
    assert int(fresh.dropout_base) == -1 and int(fresh.dropout_draws) == 0


@pytest.mark.parametrize("dropout_p", [0.0, 0.25], ids=["no-dropout", "dropout"])
def test_plain_loop_resumed_from_state_dicts_equals_the_uninterrupted_run(deterministic, dropout_p):
    """Train 10 steps straight; train 5, save ``model.state_dict()`` and ``optimizer.state_dict()``, load them into a
    model and optimizer built from another seed, train 5 more: every loss, selection and quality metric of steps 5-9
    and the final weights and optimizer state are bitwise those of the uninterrupted run (the dense warm-up, the
    hysteresis holding the dense path at step 5, the distillation draws, the metrics sample and, with dropout, the
    dropped elements all continue; the resumed process's global generator is in another state)."""
    model, optimizer = build(0, dropout_p)
    straight = train(model, optimizer, range(len(SEQ_LENS)))

    first, first_optimizer = build(0, dropout_p)
    train(first, first_optimizer, range(SAVED_AFTER))
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_optimizer = build(1, dropout_p)
    resumed.load_state_dict(saved["model"], strict=True)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    continued = train(resumed, resumed_optimizer, range(SAVED_AFTER, len(SEQ_LENS)))

    paths = ["dense" if r["selections"][0] is None else "sparse" for r in straight]
    assert paths == ["dense"] * 6 + ["sparse"] * 4, "the schedule no longer crosses the hysteresis at the resume"
    assert straight[6]["quality"][0] and straight[9]["quality"][0], "no quality metrics measured after the resume"
    for step, want, got in zip(range(SAVED_AFTER, len(SEQ_LENS)), straight[SAVED_AFTER:], continued):
        assert torch.equal(got["lm_loss"], want["lm_loss"]), f"step {step}: lm loss"
        for layer, (g, w) in enumerate(zip(got["selector_losses"], want["selector_losses"])):
            assert torch.equal(g, w), f"step {step}, layer {layer}: selector loss {g.item()} != {w.item()}"
        for layer, (g, w) in enumerate(zip(got["selections"], want["selections"])):
            assert (g is None) == (w is None), f"step {step}, layer {layer}: path {g is None and 'dense'} differs"
            assert g is None or torch.equal(g, w), f"step {step}, layer {layer}: selection"
        for layer, (g, w) in enumerate(zip(got["quality"], want["quality"])):
            assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), f"step {step}, layer {layer}"
    want_state, got_state = model.state_dict(), resumed.state_dict()
    assert want_state.keys() == got_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), f"weights: {key}"
    want_opt, got_opt = optimizer.state_dict()["state"], resumed_optimizer.state_dict()["state"]
    for index, state in want_opt.items():
        for name, value in state.items():
            assert torch.equal(got_opt[index][name], value), f"optimizer state {index}.{name}"
