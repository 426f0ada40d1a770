"""Lightning fit with context parallelism (``ContextParallel``, the ``--cp`` flag) on CPU processes (gloo,
DDP or FSDP, reference backend) against the one-process fit on the same global batches: cp = 2 on two
processes, and dp = 2 x cp = 2 on four (two data-parallel replicas, each a CP group of two ranks); and the
refusals of the callback. Structure as ``tests/parallel/test_fsdp.py``: the workers fit and write their per-step losses
and gradient norms, their validation metrics and a checkpoint; the test compares them with a one-process fit
here.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from builders import cpu_fsdp_strategy, spawn_ranks

from sparse_train.lightning.model import Transformer, TransformerConfig
from sparse_train.tasks import IGNORE_INDEX

TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
# Step 0 runs the dense warm-up (CP dense path), steps 1-2 the sparse path; the sampled target spreads its
# three query blocks over both ranks.
SPARSE = dict(
    selector="pooled",  # 8-token blocks
    block_q=8,
    block_k=8,
    top_k=1,
    window=1,
    sinks=1,
    backend="reference",
    dense_warmup_steps=1,
    dense_fallback=False,
    distill="sampled",
    distill_query_blocks=3,
)
SEQ = 64
ROWS_PER_STEP = 2  # per data-parallel replica
STEPS = 3
CLIP = 1e-3  # below both groups' norms: both are clipped on every step
LR = dict(lr=1e-2, selector_lr=3e-2, weight_decay=0.1, warmup_steps=1)
VAL_ROWS_PER_REPLICA = 2


def _rows(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` rows; the labelled counts differ from row to row (so between the replicas' rows) and
    between the two halves of each row (so between the ranks' shards)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY["vocab_size"], (count, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    for i in range(labels.shape[0]):
        labels[i, : (5 + 7 * i) % (SEQ - 8)] = IGNORE_INDEX
    return [{"tokens": t, "labels": lab} for t, lab in zip(tokens, labels)]


def _fit(
    strategy,
    devices: int,
    out_dir: str,
    tag: str,
    rank: int = 0,
    cp: int = 1,
    replicas: int = 1,
    precision: str | None = "64-true",
    checkpointing: bool = False,
) -> None:
    """Fit ``STEPS`` steps (one epoch) and write the logged losses, each step's gradient norms before the
    clipping, the validation metrics at the end of the epoch (the trained model), how often the first layer's
    attention ran in training mode, and a checkpoint. The data module shards the rows by
    :func:`data_parallel_rank` (``RowShards``, in order): ``replicas`` data-parallel replicas of
    ``ROWS_PER_STEP`` rows per step together read the global batches of one process with
    ``replicas * ROWS_PER_STEP`` rows per step (``devices == 1``). ``precision=None``: the strategy's own
    precision plugin."""
    from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
    from torch.utils.data import DataLoader

    import sparse_train as st
    from sparse_train.lightning import SparseLMModule
    from sparse_train.lightning.context_parallel import ContextParallel, data_parallel_rank
    from sparse_train.lightning.text_data import RowShards
    from sparse_train.lightning.training import gradient_shard_group

    record: dict = {"losses": [], "norms": [], "paths": [], "attention_calls": 0}
    batch_size = ROWS_PER_STEP * (replicas if devices == 1 else 1)

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            def count(attention, args, output):
                record["attention_calls"] += attention.training

            # FSDP forwards the attribute lookups to the layer its unit wraps: this is the layer's own module.
            pl_module.model.blocks[0].attn.register_forward_hook(count)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # Before the clipping; a max_norm no norm reaches scales nothing. The norms of FSDP's shards are
            # reduced over the group that holds them: every rank gets the whole gradient's.
            group = gradient_shard_group(trainer.strategy)
            record["norms"].append([float(n) for n in st.clip_grad_norms(pl_module.model, 1e30, process_group=group)])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record["losses"].append(
                {key: float(trainer.callback_metrics[f"train/{key}"]) for key in ("lm_loss", "selector_loss")}
            )
            record["paths"] = [core._last_path for core in pl_module.model.sparse_cores()]

    class Rows(LightningDataModule):
        def _loader(self, rows, batch):
            shard, shards = data_parallel_rank(self.trainer)
            record["replicas"] = shards
            return DataLoader(rows, batch_size=batch, sampler=RowShards(len(rows), shard, shards, shuffle=False))

        def train_dataloader(self):
            return self._loader(_rows(STEPS * ROWS_PER_STEP * replicas, seed=2), batch_size)

        def val_dataloader(self):
            return self._loader(_rows(VAL_ROWS_PER_REPLICA * replicas, seed=3), batch_size // ROWS_PER_STEP)

    seed_everything(0)
    config = TransformerConfig(**TINY, attention="sparse", sparse=SPARSE, activation_checkpointing=checkpointing)
    module = SparseLMModule(config, **LR)
    callbacks = [Record()] + ([ContextParallel(cp)] if cp > 1 else [])
    trainer = Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=os.path.join(out_dir, tag),
    )
    # Validated at the end of the fit's only epoch, not by trainer.validate afterwards: that second run sets the
    # strategy up again, and Lightning's FSDP then finds the layers' units and leaves the root unwrapped.
    trainer.fit(module, datamodule=Rows())
    trainer.save_checkpoint(os.path.join(out_dir, f"{tag}.ckpt"))
    with open(os.path.join(out_dir, f"{tag}.rank{rank}.json"), "w") as f:
        json.dump({**record, "val": module.final_metrics}, f)


def _fsdp_float64():
    """Lightning's FSDPStrategy on the CPU (``builders.cpu_fsdp_strategy``) in float64, so that the FSDP fit is
    held to the float64 tolerances of the DDP fit. Lightning's FSDP precision plugin offers ``32-true`` at
    most; its dtype enters only through the module cast, the default dtype of the forward and FSDP's
    ``MixedPrecision``, given here as the strategy's own (``keep_buffer_dtypes`` leaves a user's config alone, and
    the one-process float64 fit keeps its buffers in float64 too). Sharding, the gradient reduction and the
    clipping are FSDP's and ours, unchanged."""
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp import MixedPrecision

    class FSDPFloat64(FSDPPrecision):
        def __init__(self) -> None:
            super().__init__("32-true")
            self._desired_input_dtype = torch.float64

    double = MixedPrecision(param_dtype=torch.float64, reduce_dtype=torch.float64, buffer_dtype=torch.float64)
    return cpu_fsdp_strategy(precision_plugin=FSDPFloat64(), mixed_precision=double)


def _fit_worker(
    rank: int, port: int, out_dir: str, world: int, cp: int, kind: str = "ddp", checkpointing: bool = False
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    strategy, precision = (_fsdp_float64(), None) if kind == "fsdp" else ("ddp", "64-true")
    _fit(
        strategy,
        world,
        out_dir,
        f"{kind}_dp{world // cp}cp{cp}",
        rank=rank,
        cp=cp,
        replicas=world // cp,
        precision=precision,
        checkpointing=checkpointing,
    )


def _weights(path) -> dict[str, torch.Tensor]:
    from sparse_train.lightning import load_weights

    model = Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE)).double()
    load_weights(model, str(path))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_against_one_process(tmp_path, kind: str, replicas: int, cp: int, checkpointing: bool = False) -> None:
    """Spawn the ``kind`` fit on ``replicas * cp`` processes, fit one process on the same global batches, and
    compare them (the tolerances are explained in ``test_cp_fit_matches_one_process_fit``)."""
    world = replicas * cp
    spawn_ranks(_fit_worker, world, str(tmp_path), world, cp, kind, checkpointing)
    _fit("auto", 1, str(tmp_path), "single", replicas=replicas)
    read = lambda tag, r=0: json.loads((tmp_path / f"{tag}.rank{r}.json").read_text())  # noqa: E731
    tag = f"{kind}_dp{replicas}cp{cp}"
    single = read("single")
    assert single["paths"] == ["sparse", "sparse"]
    assert single["attention_calls"] == STEPS
    for rank in range(world):
        got = read(tag, rank)
        assert got["replicas"] == replicas
        assert got["paths"] == single["paths"]
        assert got["attention_calls"] == STEPS * (2 if checkpointing else 1), rank  # the recompute ran
        assert len(got["losses"]) == len(got["norms"]) == STEPS
        for step, (have, want) in enumerate(zip(got["losses"], single["losses"])):
            assert have["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-6), (rank, step)
            assert have["selector_loss"] == pytest.approx(want["selector_loss"], rel=1e-5), (rank, step)
        for step, (have, want) in enumerate(zip(got["norms"], single["norms"])):
            assert have[0] == pytest.approx(want[0], rel=1e-12), (rank, step)
            assert have[1] == pytest.approx(want[1], rel=1e-5), (rank, step)
        assert got["val"]["val/loss"] == pytest.approx(single["val"]["val/loss"], rel=1e-6), rank
        # the same argmax on the same logits (float64 up to ~1e-15): the same count of correct answers
        assert got["val"]["val/acc"] == single["val"]["val/acc"], rank
    want, have = _weights(tmp_path / "single.ckpt"), _weights(tmp_path / f"{tag}.ckpt")
    for name, w in want.items():
        gap = float((have[name] - w).abs().max())
        if ".core." in name:
            assert gap <= 1e-5 * LR["selector_lr"] * STEPS, (name, gap)
        else:
            assert gap <= 1e-12, (name, gap)
    moved = want["blocks.0.attn.wq.weight"]
    torch.manual_seed(0)
    assert (
        float(
            (
                moved
                - Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE))
                .double()
                .blocks[0]
                .attn.wq.weight
            )
            .abs()
            .max()
        )
        > 1e-4
    )  # training moved the weights


@pytest.mark.parametrize("replicas,cp", [(1, 2), (2, 2)], ids=["cp2", "dp2_cp2"])
def test_cp_fit_matches_one_process_fit(tmp_path, replicas, cp):
    """Three clipped AdamW steps of a tiny sparse model (dense warm-up step, then sparse, sampled
    distillation) with ``ContextParallel(cp)`` under DDP on ``replicas * cp`` gloo processes, every rank
    holding a zig-zag half of each row of its replica (``dp2_cp2``: ranks 0-1 and 2-3 are two CP groups
    reading different rows), against one process on the global batches, the rows of every replica
    (float64): the logged ``train/lm_loss`` and ``train/selector_loss`` of every step, on every rank (the
    training logic computes the cross-entropy in float32: a few float32 ulps; the selector loss is the mean
    of the replicas' losses, which is the global batch's here because every replica has as many valid
    distillation rows); each step's gradient norms before the clipping (the model's to 1e-12 relative, the
    selectors' to 1e-5, as their loss: the clipping and Adam hide a gradient scaled by a constant, the norms
    do not); the final weights: the model's to 1e-12 absolute (float64; measured ~1e-15), the selectors'
    within a 1e-5 relative difference of each of the three Adam updates of size ~lr (the selector scores and
    distils in float32 and the ranks sum other rows in another order; measured up to 6e-7 against a bound of
    9e-7); and ``val/loss`` and ``val/acc`` of the trained model, token-weighted over the validation rows of
    every replica (their labelled counts differ, so a mean of the ranks' or the replicas' means would
    differ) as one process computes them."""
    _check_against_one_process(tmp_path, "ddp", replicas, cp)


@pytest.mark.parametrize("replicas,checkpointing", [(1, False), (2, True)], ids=["cp2", "dp2_cp2_checkpointing"])
def test_fsdp_cp_fit_matches_one_process_fit(tmp_path, replicas, checkpointing):
    """The fit of ``test_cp_fit_matches_one_process_fit`` under Lightning's FSDP (FULL_SHARD over the whole
    world, each layer its own unit, in float64: :func:`_fsdp_float64`) with ``ContextParallel(2)``, against
    one process, with the same tolerances. ``dp2_cp2_checkpointing``: four ranks, so FSDP's group (the
    world) differs from the CP groups (ranks 0-1, 2-3), and the model's activation checkpointing on (each
    layer recomputed, its K/V all-gathers again, inside FSDP's backward; the one-process fit runs without
    it)."""
    _check_against_one_process(tmp_path, "fsdp", replicas, 2, checkpointing)


REFUSALS = [
    "world_not_multiple",
    "cp_above_world",
    "strategy",
    "fsdp_hybrid",
    "fsdp_process_group",
    "fsdp_device_mesh",
    "fsdp_accepted",
    "sampler",
    "model",
    "size",
]


@pytest.mark.parametrize("case", REFUSALS, ids=REFUSALS)
def test_context_parallel_callback_refusals(case):
    """The callback refuses what it cannot run, naming it: a world size that is not a multiple of cp (both
    numbers in the message), a strategy other than DDP and FSDP, FSDP's hybrid sharding, an FSDP
    ``process_group`` or ``device_mesh`` of the user's (FSDP would average over that group instead of the
    world), Lightning's distributed sampler, a model other than our Transformer, a size below 1. The other
    cases run at world_size=4 with cp=2 (two data-parallel CP groups), which passes the world-size check: each
    fails on its own refusal. ``fsdp_accepted``: FSDP with FULL_SHARD, SHARD_GRAD_OP and NO_SHARD passes the
    strategy check and reaches the model's refusal."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy

    from sparse_train.lightning import SparseLMModule
    from sparse_train.lightning.context_parallel import ContextParallel
    from sparse_train.lightning.model import Block

    if case == "size":
        with pytest.raises(ValueError, match="ContextParallel.size"):
            ContextParallel(0)
        return
    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE))
    trainer = SimpleNamespace(
        world_size=4,
        global_rank=0,
        strategy=DDPStrategy(),
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
    )
    size = 2
    model_refused = "supports sparse_train.lightning.model.Transformer"
    want = {
        "world_not_multiple": r"world_size=6 is not a multiple of cp=4",
        "cp_above_world": r"world_size=2 is not a multiple of cp=4",
        "strategy": "runs under DDP or FSDP",
        "fsdp_hybrid": "sharding_strategy=HYBRID_SHARD is not supported",
        "fsdp_process_group": r"FSDPStrategy\(process_group=\.\.\.\) is not supported",
        "fsdp_device_mesh": r"FSDPStrategy\(device_mesh=\.\.\.\) is not supported",
        "fsdp_accepted": model_refused,
        "sampler": "use_distributed_sampler=false",
        "model": model_refused,
    }[case]
    strategies = [trainer.strategy]
    if case == "world_not_multiple":
        trainer.world_size, size = 6, 4
    elif case == "cp_above_world":
        trainer.world_size, size = 2, 4
    elif case == "strategy":
        # DeepSpeed is a DDPStrategy subclass: refused by name, not let through by inheritance (built without
        # __init__, which needs the deepspeed package; the check reads only the type)
        strategies = [SingleDeviceStrategy(device=torch.device("cpu")), DeepSpeedStrategy.__new__(DeepSpeedStrategy)]
    elif case == "fsdp_hybrid":
        strategies = [FSDPStrategy(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={Block})]
    elif case == "fsdp_process_group":
        strategies = [FSDPStrategy(process_group=object())]  # never used: refused before FSDP sees it
    elif case == "fsdp_device_mesh":
        strategies = [FSDPStrategy(device_mesh=(2, 2))]
    elif case == "fsdp_accepted":
        strategies = [FSDPStrategy(sharding_strategy=name) for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]
        module = SimpleNamespace(model=torch.nn.Linear(2, 2))
    elif case == "sampler":
        trainer._accelerator_connector.use_distributed_sampler = True
    else:
        module = SimpleNamespace(model=torch.nn.Linear(2, 2))
    for strategy in strategies:
        trainer.strategy = strategy
        with pytest.raises(ValueError, match=want):
            ContextParallel(size).setup(trainer, module, "fit")


CLI_TINY = [
    "--model.init_args.model.d_model=32",
    "--data.init_args.seq_len=128",
    "--data.init_args.curriculum=[]",
    "--data.init_args.batch_size=2",
    "--data.init_args.val_samples=2",
    "--trainer.accelerator=cpu",
    "--logger_backend=none",
]


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


def test_data_parallel_rank_counts_a_cp_group_as_one_replica():
    """The ranks of one CP group are one data-parallel replica: rank 1 of a cp=2 run reads replica 0's
    rows, so both ranks load the same batch; with four ranks and cp=2, ranks 0-1 are replica 0 and ranks
    2-3 replica 1 of 2 (the consecutive ranks the callback's device mesh groups)."""
    from types import SimpleNamespace

    from sparse_train.lightning.context_parallel import ContextParallel, data_parallel_rank

    assert data_parallel_rank(None) == (0, 1)
    assert data_parallel_rank(SimpleNamespace(global_rank=1, world_size=2, callbacks=[])) == (1, 2)
    assert data_parallel_rank(SimpleNamespace(global_rank=1, world_size=2, callbacks=[ContextParallel(2)])) == (0, 1)
    four = [
        data_parallel_rank(SimpleNamespace(global_rank=r, world_size=4, callbacks=[ContextParallel(2)]))
        for r in range(4)
    ]
    assert four == [(0, 2), (0, 2), (1, 2), (1, 2)]


def _data_module(kind: str, tmp_path):
    from sparse_train.lightning import ByteLMDataModule, RetrievalDataModule

    if kind == "retrieval":
        return RetrievalDataModule(seq_len=128, num_pairs=2, num_queries=2, batch_size=2, curriculum=[], val_samples=2)
    if kind == "byte_lm":
        root = tmp_path / "bytes"
        root.mkdir()
        for i in range(2):
            (root / f"f{i}.py").write_text("".join(f"x{i}_{j} = {j * j}\n" for j in range(60)))
        module = ByteLMDataModule(paths=[str(root)], seq_len=32, batch_size=2, val_fraction=0.0, val_samples=2)
    else:
        pytest.importorskip("transformers")
        from builders import save_tiny_tokenizer, write_tiny_corpus

        from sparse_train.lightning.text_data import TextDataModule

        module = TextDataModule(
            [str(write_tiny_corpus(tmp_path / "corpus"))],
            seq_len=17,
            batch_size=2,
            val_fraction=0.2,
            tokenizer_path=str(save_tiny_tokenizer(tmp_path / "tok")),
        )
    module.setup("fit")
    return module


@pytest.mark.parametrize("kind", ["retrieval", "byte_lm", "text"], ids=["retrieval", "byte_lm", "text"])
def test_data_modules_give_a_cp_group_the_same_rows_and_replicas_different_rows(kind, tmp_path):
    """Four ranks with ``ContextParallel(2)`` (two CP groups, Lightning's sampler off as ``--cp`` sets it):
    the two ranks of a group load the same training batches and the two groups different ones, for every
    data module the callback trains with."""
    from types import SimpleNamespace

    from sparse_train.lightning.context_parallel import ContextParallel

    data = _data_module(kind, tmp_path)
    batches = []
    for rank in range(4):
        data.trainer = SimpleNamespace(
            global_rank=rank,
            world_size=4,
            callbacks=[ContextParallel(2)],
            max_steps=2,
            global_step=0,
            accumulate_grad_batches=1,
            _accelerator_connector=SimpleNamespace(use_distributed_sampler=False),
        )
        loader = iter(data.train_dataloader())
        batches.append(torch.cat([next(loader)["tokens"] for _ in range(2)]))
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[2], batches[3])
    assert not torch.equal(batches[0], batches[2])
