"""Lightning fit with context parallelism (``ContextParallel``, the ``--cp`` flag) on two CPU processes
(gloo, DDP, reference backend) against the one-process fit on the same batches, and the refusals of the
callback. Structure as ``tests/test_fsdp.py``: the workers fit and write their per-step losses and a
checkpoint; the test compares them with a one-process fit here.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from builders import spawn_ranks

from sparse_train.lightning.model import Transformer, TransformerConfig
from sparse_train.tasks import IGNORE_INDEX

TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
# Step 0 runs the dense warm-up (CP dense path), steps 1-2 the sparse path; the sampled target spreads its
# three query blocks over both ranks.
SPARSE = dict(block_q=8, block_k=8, top_k=1, window=1, sinks=1, backend="reference", dense_warmup_steps=1,
              dense_fallback=False, distill="sampled", distill_query_blocks=3)
SEQ = 64
WORLD = 2
ROWS_PER_STEP = 2
STEPS = 3
CLIP = 1e-3  # below both groups' norms: both are clipped on every step
LR = dict(lr=1e-2, selector_lr=3e-2, weight_decay=0.1, warmup_steps=1)


def _rows() -> list[dict[str, torch.Tensor]]:
    """``STEPS * ROWS_PER_STEP`` rows; the labelled counts differ between the two halves of each row (so
    between the ranks' shards)."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, TINY["vocab_size"], (STEPS * ROWS_PER_STEP, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    for i in range(labels.shape[0]):
        labels[i, : 5 + 7 * i] = IGNORE_INDEX
    return [{"tokens": t, "labels": lab} for t, lab in zip(tokens, labels)]


def _fit(strategy, devices: int, out_dir: str, tag: str, rank: int = 0, cp: int = 1) -> None:
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    from sparse_train.lightning import SparseLMModule
    from sparse_train.lightning.context_parallel import ContextParallel

    losses: list[dict[str, float]] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append({key: float(trainer.callback_metrics[f"train/{key}"]) for key in ("lm_loss", "selector_loss")})

    seed_everything(0)
    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE), **LR)
    loader = DataLoader(_rows(), batch_size=ROWS_PER_STEP, shuffle=False)
    callbacks = [Record()] + ([ContextParallel(cp)] if cp > 1 else [])
    trainer = Trainer(max_steps=STEPS, accelerator="cpu", devices=devices, strategy=strategy, precision="64-true",
                      gradient_clip_val=CLIP, use_distributed_sampler=False, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
                      default_root_dir=os.path.join(out_dir, tag))
    trainer.fit(module, train_dataloaders=loader)
    trainer.save_checkpoint(os.path.join(out_dir, f"{tag}.ckpt"))
    paths = [core._last_path for core in module.model.sparse_cores()]
    with open(os.path.join(out_dir, f"{tag}.rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "paths": paths}, f)


def _fit_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    _fit("ddp", WORLD, out_dir, "cp", rank=rank, cp=WORLD)


def _weights(path) -> dict[str, torch.Tensor]:
    from sparse_train.lightning import load_weights

    model = Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE)).double()
    load_weights(model, str(path))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_cp_fit_matches_one_process_fit(tmp_path):
    """Three clipped AdamW steps of a tiny sparse model (dense warm-up step, then sparse, sampled
    distillation) with ``ContextParallel(2)`` under DDP on two gloo processes, every rank holding a zig-zag
    half of each row, against one process on the same batches (float64): the logged ``train/lm_loss`` and
    ``train/selector_loss`` of every step, on every rank (the training logic computes the cross-entropy in
    float32: a few float32 ulps), and the final weights: the model's to 1e-12 absolute (float64; measured
    ~1e-15), the selectors' within a 1e-5 relative difference of each of the three Adam updates of size
    ~lr (the selector scores and distils in float32 and the ranks sum other rows in another order;
    measured ~1e-7 against a bound of 9e-7)."""
    spawn_ranks(_fit_worker, WORLD, str(tmp_path))
    _fit("auto", 1, str(tmp_path), "single")
    read = lambda tag, r=0: json.loads((tmp_path / f"{tag}.rank{r}.json").read_text())  # noqa: E731
    single = read("single")
    assert single["paths"] == ["sparse", "sparse"]
    for rank in range(WORLD):
        got = read("cp", rank)
        assert got["paths"] == single["paths"]
        assert len(got["losses"]) == STEPS
        for step, (have, want) in enumerate(zip(got["losses"], single["losses"])):
            assert have["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-6), (rank, step)
            assert have["selector_loss"] == pytest.approx(want["selector_loss"], rel=1e-5), (rank, step)
    want, have = _weights(tmp_path / "single.ckpt"), _weights(tmp_path / "cp.ckpt")
    for name, w in want.items():
        gap = float((have[name] - w).abs().max())
        if ".core." in name:
            assert gap <= 1e-5 * LR["selector_lr"] * STEPS, (name, gap)
        else:
            assert gap <= 1e-12, (name, gap)
    moved = _weights(tmp_path / "single.ckpt")["blocks.0.attn.wq.weight"]
    torch.manual_seed(0)
    assert float((moved - Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE)).double()
                  .blocks[0].attn.wq.weight).abs().max()) > 1e-4  # training moved the weights


@pytest.mark.parametrize("case", ["world", "strategy", "sampler", "model", "size"])
def test_context_parallel_callback_refusals(case):
    """The callback refuses what it cannot run, naming it: world_size != cp, a strategy other than DDP,
    Lightning's distributed sampler, a model other than our Transformer, a size below 1."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from sparse_train.lightning import SparseLMModule
    from sparse_train.lightning.context_parallel import ContextParallel

    if case == "size":
        with pytest.raises(ValueError, match="ContextParallel.size"):
            ContextParallel(0)
        return
    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE))
    trainer = SimpleNamespace(world_size=2, strategy=DDPStrategy(),
                              _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))
    want = {"world": "world_size == cp", "strategy": "runs under DDP", "sampler": "use_distributed_sampler=false",
            "model": "supports sparse_train.lightning.model.Transformer"}[case]
    if case == "world":
        trainer.world_size = 4
    elif case == "strategy":
        trainer.strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    elif case == "sampler":
        trainer._accelerator_connector.use_distributed_sampler = True
    else:
        module = SimpleNamespace(model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=want):
        ContextParallel(2).setup(trainer, module, "fit")


CLI_TINY = ["--model.init_args.model.d_model=32", "--data.init_args.seq_len=128", "--data.init_args.curriculum=[]",
            "--data.init_args.batch_size=2", "--data.init_args.val_samples=2", "--trainer.accelerator=cpu",
            "--logger_backend=none"]


def test_cli_cp_flag_installs_the_callback(tmp_path, monkeypatch):
    """``--cp 2`` adds ``ContextParallel(2)`` and turns Lightning's distributed sampler off (the ranks of a
    sequence load the same rows); without it there is no callback; ``--cp 0`` is a one-line config error."""
    from sparse_train import cli
    from sparse_train.lightning.context_parallel import ContextParallel

    monkeypatch.chdir(tmp_path)
    built = cli.run_cli(["--config", "retrieval", *CLI_TINY, "--cp", "2"], run=False)
    callbacks = [cb for cb in built.trainer.callbacks if isinstance(cb, ContextParallel)]
    assert [cb.size for cb in callbacks] == [2]
    assert built.trainer._accelerator_connector.use_distributed_sampler is False
    plain = cli.run_cli(["--config", "retrieval", *CLI_TINY], run=False)
    assert not any(isinstance(cb, ContextParallel) for cb in plain.trainer.callbacks)
    with pytest.raises(SystemExit, match="--cp must be an int >= 1"):
        cli.run_cli(["--config", "retrieval", *CLI_TINY, "--cp", "0"], run=False)


def test_data_modules_shard_by_data_parallel_rank_under_cp():
    """The ranks of one CP group are one data-parallel replica: rank 1 of a cp=2 run reads replica 0's
    rows, so both ranks load the same batch."""
    from types import SimpleNamespace

    from sparse_train.lightning.context_parallel import ContextParallel, data_parallel_rank

    assert data_parallel_rank(None) == (0, 1)
    assert data_parallel_rank(SimpleNamespace(global_rank=1, world_size=2, callbacks=[])) == (1, 2)
    assert data_parallel_rank(SimpleNamespace(global_rank=1, world_size=2, callbacks=[ContextParallel(2)])) == (0, 1)
