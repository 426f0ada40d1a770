"""Lightning stack: data modules, model wiring, timing callback keys, and the three-stage dense -> selector
-> sparse fine-tuning pipeline with exact resume (the task generators themselves: tests/test_tasks.py)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml
from builders import assert_mid_epoch_resume_equals_straight, load_script

import sparse_train as st
from sparse_train import cli
from sparse_train.lightning import (
    ByteLMDataModule,
    RetrievalDataModule,
    SparseLMModule,
    StepTimer,
    Transformer,
    TransformerConfig,
    load_weights,
)

TINY = dict(vocab_size=70, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
SPARSE = dict(block_q=32, block_k=32, top_k=2, window=1, sinks=1, backend="reference")


# ----------------------------------------------------------------------------------------- data
def test_validation_reports_needle_block_recall_per_layer(tmp_path):
    from lightning.pytorch import Trainer

    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=dict(SPARSE, dense_warmup_steps=0)))
    dm = RetrievalDataModule(
        seq_len=256, num_pairs=2, num_queries=2, num_keys=4, num_values=8, batch_size=2, val_samples=4
    )
    trainer = Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(module, dm)
    got = module.final_metrics
    layers = [got["val/needle_recall/layer0"], got["val/needle_recall/layer1"]]
    assert all(0.0 <= x <= 1.0 for x in layers)
    assert got["val/needle_recall"] == pytest.approx(sum(layers) / 2)
    assert got["val/needle_recall_best_layer"] == max(layers)


def test_final_line_reports_accuracy_density_and_the_dense_twin(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer

    from sparse_train.lightning import training

    lines: list[str] = []
    monkeypatch.setattr(training, "rank_zero_info", lines.append)
    module = SparseLMModule(
        TransformerConfig(**TINY, attention="sparse", sparse=dict(SPARSE, dense_warmup_steps=0)), dense_twin_acc=0.5
    )
    dm = RetrievalDataModule(
        seq_len=256, num_pairs=2, num_queries=2, num_keys=4, num_values=8, batch_size=2, val_samples=4
    )
    trainer = Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        default_root_dir=tmp_path,
        callbacks=[StepTimer()],
    )
    trainer.fit(module, dm)
    done = [line for line in lines if line.startswith("[sparse-train] done: 2 steps")]
    assert len(done) == 1, lines
    density = float(trainer.callback_metrics["attn/density"])
    assert 0.0 < density < 1.0  # 256 tokens in blocks of 32 with 2 + 1 + 1 blocks per row: sparse
    acc = module.final_metrics["val/acc"]
    assert f"val/acc = {acc:.4f}" in done[0] and f"density = {density:.4f}" in done[0]
    assert f"dense twin val/acc = 0.5000 (this run: {acc / 0.5:.1%} of it)" in done[0]


def test_curriculum_data_module_batches():
    dm = RetrievalDataModule(
        seq_len=128,
        num_pairs=2,
        num_queries=2,
        num_keys=4,
        batch_size=2,
        train_steps=3,
        curriculum=[{"steps": 1, "seq_len": 64, "batch_size": 3}],
    )
    shapes = [tuple(b["tokens"].shape) for b in dm.train_dataloader()]
    assert shapes == [(3, 64), (2, 128), (2, 128)]


def test_byte_lm_split_and_determinism(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 50)
    dm = ByteLMDataModule(paths=[str(tmp_path)], pattern="*.txt", seq_len=32, batch_size=2, val_fraction=0.2)
    dm.setup()
    assert dm.train_bytes.numel() > 0 and dm.val_bytes.numel() > 0
    train_text, val_text = bytes(dm.train_bytes.tolist()), bytes(dm.val_bytes.tolist())
    for i in range(40):  # each file lands in exactly one split
        marker = f"file {i} ".encode() * 2
        assert (marker in train_text) != (marker in val_text)
    a = next(iter(dm.train_dataloader()))
    b = next(iter(dm.train_dataloader()))
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"][:, :-1], a["tokens"][:, 1:])
    assert cli is not None and Path(__import__("os").__file__).parent.is_dir()  # default corpus root exists


@pytest.mark.parametrize("fork_step", [3, 9], ids=["in-epoch-0", "in-epoch-1"])
def test_byte_lm_mid_epoch_resume_continues_the_crop_stream(tmp_path, fork_step):
    """A byte-LM run stopped in the middle of an epoch of 7 batches (ForkPoint after 3 or 9 steps) and resumed to
    step 10 equals 10 steps straight: the resumed loader continues the interrupted epoch's crops where it stopped
    (it does not read that epoch's first crops again), and the next epoch is whole."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"f{i}.txt").write_text(f"text {i} of the corpus. " * 40)
    assert_mid_epoch_resume_equals_straight(
        lambda: ByteLMDataModule(
            paths=[str(corpus)], pattern="*.txt", seq_len=16, batch_size=2, val_fraction=0.2, train_samples=14
        ),
        tmp_path,
        fork_step,
    )


# ----------------------------------------------------------------------------------------- model
def test_sparse_model_with_full_selection_matches_dense_twin():
    torch.manual_seed(0)
    sparse = Transformer(TransformerConfig(**TINY, attention="sparse", sparse=dict(SPARSE, top_k=16)))
    dense = Transformer(TransformerConfig(**TINY, attention="dense"))
    selector = {n for n, _ in sparse.named_parameters() if ".core." in n}
    assert selector and {n for n, _ in sparse.named_parameters()} - selector == {n for n, _ in dense.named_parameters()}
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if ".core." not in k})
    tokens = torch.randint(70, (2, 100))
    # top_k >= number of key blocks: every causal block is selected, so sparse attention == dense.
    torch.testing.assert_close(sparse(tokens), dense(tokens), rtol=1e-4, atol=1e-4)
    partial = Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE))
    partial.load_state_dict(sparse.state_dict())
    assert not torch.allclose(partial(torch.randint(70, (1, 200))), dense(torch.randint(70, (1, 200))))


def test_norms_hand_the_autocast_dtype_to_their_matmuls():
    """Under autocast every RMSNorm emits the autocast dtype (the float32 result cast once: bitwise what the
    matmuls' own casts gave), so a forward casts each float32 [B, N, d_model] activation once per norm, not once
    per consuming matmul (q, k, v, gate, up and the LM head: 5 per block + 1)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparse_train.lightning.model import rms_norm

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**TINY, attention="dense"))
    tokens = torch.randint(70, (2, 40))
    width = (2, 40, TINY["d_model"])

    class CountActivationCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (
                func.overloadpacket is torch.ops.aten._to_copy
                and tuple(args[0].shape) == width
                and args[0].dtype == torch.float32
                and out.dtype == torch.bfloat16
            ):
                type(self).casts += 1
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16), CountActivationCasts():
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    assert CountActivationCasts.casts == 2 * TINY["n_layers"] + 1
    x = torch.randn(width)
    norm = model.blocks[0].attn_norm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, rms_norm(x, norm.weight, norm.eps).to(torch.bfloat16))
    assert norm(x).dtype == torch.float32  # no autocast: unchanged
    update = torch.randn(width, dtype=torch.bfloat16)
    total, normed = norm(x, update)  # the block's residual add fused with its second norm
    assert torch.equal(total, x + update) and torch.equal(normed, norm(x + update))


# ----------------------------------------------------------------------------------------- callback
def test_step_timer_logs_expected_keys(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    module = SparseLMModule(
        TransformerConfig(**TINY, attention="sparse", sparse=dict(SPARSE, profile=True, metrics_every=1))
    )
    dm = RetrievalDataModule(
        seq_len=128, num_pairs=2, num_queries=2, num_keys=4, num_values=8, batch_size=2, val_samples=2
    )
    timer = StepTimer()
    trainer = Trainer(
        max_steps=3,
        logger=CSVLogger(tmp_path, name="t"),
        callbacks=[timer],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        limit_val_batches=1,
    )
    trainer.fit(module, dm)
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    keys = {k for r in rows for k, v in r.items() if v not in ("", None)}
    expected = {
        "time/forward_ms",
        "time/backward_ms",
        "time/optimizer_ms",
        "time/step_ms",
        "throughput/tokens_per_s",
        "attn/density",
        "attn/selector_loss",
        "attn/mass_recall_mean",
        "attn/mass_recall_p5",
        "attn/layers/0/mass_recall_mean",
        "attn/time/selector_ms",
        "attn/time/plan_ms",
        "attn/time/attn_fwd_ms",
        "attn/time/attn_bwd_ms",
        "train/loss",
        "train/selector_loss",
        "val/acc",
        "val/loss",
    }
    assert expected <= keys, expected - keys
    assert any(k.startswith("attn/fallbacks/") for k in keys)
    m = timer.last_metrics
    assert all(m[k] > 0 for k in ("time/forward_ms", "time/backward_ms", "time/optimizer_ms"))
    assert m["time/forward_ms"] + m["time/backward_ms"] + m["time/optimizer_ms"] <= m["time/step_ms"] + 1e-6
    assert m["throughput/tokens_per_s"] == pytest.approx(2 * 128 / (m["time/step_ms"] / 1e3))


def test_plot_script_renders_csv(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,train/loss,val/acc,time/forward_ms,time/backward_ms,attn/density\n"
        "0,0,2.0,,1.0,2.0,0.3\n0,1,1.5,0.5,1.1,2.1,0.3\n"
    )
    plot = load_script("plot_metrics")
    series = plot.read_csv_metrics(path)
    assert series["train/loss"] == [(0.0, 2.0), (1.0, 1.5)] and series["val/acc"] == [(1.0, 0.5)]
    written = plot.plot([("a", series), ("b", series)], tmp_path / "out")
    assert {p.name for p in written} == {"loss.png", "accuracy.png", "step_time.png", "attention.png"}


# ----------------------------------------------------------------------------------------- fine-tuning
def _stage_args(recipe: str, root: Path, steps: int, extra: list[str] = ()) -> list[str]:
    args = [
        "fit",
        "--config",
        recipe,
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        f"--trainer.max_steps={steps}",
        "--trainer.enable_progress_bar=false",
        "--logger_backend=csv",
        f"--trainer.default_root_dir={root}",
        "--data.init_args.seq_len=128",
        "--data.init_args.batch_size=2",
        "--data.init_args.curriculum=[]",
        "--data.init_args.val_samples=2",
        "--data.init_args.eval_batch_size=2",
        "--model.init_args.model.d_model=32",
    ]
    if "stage1" not in recipe:  # 4 key blocks of 32 at N=128, so the selection is really sparse
        args += ["--model.init_args.model.sparse.block_q=32", "--model.init_args.model.sparse.block_k=32"]
    return [*args, *extra]


def _ckpt_cb(path: Path) -> list[str]:
    return [
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={path}",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.every_n_train_steps=1",
    ]


def test_three_stage_finetuning_with_exact_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Stage 1: dense base.
    cli.run_cli(_stage_args("finetune_stage1_dense", tmp_path / "s1", 3))
    s1 = torch.load("runs/finetune/stage1/last.ckpt", weights_only=False)
    assert not any(".core." in k for k in s1["state_dict"])

    # Stage 2: selectors only, base frozen; loads stage 1 from the recipe's own init_from path.
    r2 = cli.run_cli(_stage_args("finetune_stage2_selector", tmp_path / "s2", 3))
    s2 = torch.load("runs/finetune/stage2/last.ckpt", weights_only=False)["state_dict"]
    base = {k for k in s2 if ".core." not in k}
    assert base == set(s1["state_dict"])
    assert all(torch.equal(s2[k], s1["state_dict"][k]) for k in base), "stage 2 changed a frozen base weight"
    fresh = SparseLMModule(r2.model.model_config)
    selector = [k for k in s2 if ".core." in k]
    assert selector and any(not torch.equal(s2[k], fresh.state_dict()[k]) for k in selector), (
        "stage 2 did not train the selectors"
    )

    # Stage 3: everything trains; 4 steps straight vs 2 steps + resume for 2 must agree exactly.
    straight = cli.run_cli(_stage_args("finetune_stage3_sparse", tmp_path / "a", 4, _ckpt_cb(tmp_path / "a_ckpt")))
    cli.run_cli(_stage_args("finetune_stage3_sparse", tmp_path / "b", 2, _ckpt_cb(tmp_path / "b_ckpt")))
    half = torch.load(tmp_path / "b_ckpt" / "last.ckpt", weights_only=False)
    assert half["global_step"] == 2 and half["optimizer_states"][0]["state"], "no optimizer state saved"
    assert any(".core." in k for k in half["state_dict"])
    resumed = cli.run_cli(
        _stage_args(
            "finetune_stage3_sparse",
            tmp_path / "b",
            4,
            _ckpt_cb(tmp_path / "b_ckpt2") + [f"--ckpt_path={tmp_path / 'b_ckpt' / 'last.ckpt'}"],
        )
    )
    assert resumed.trainer.global_step == 4
    sa, sb = straight.model.state_dict(), resumed.model.state_dict()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=1e-6, msg=f"resume diverged at {key}")
    oa = straight.trainer.optimizers[0].state_dict()["state"]
    ob = resumed.trainer.optimizers[0].state_dict()["state"]
    for idx in oa:
        torch.testing.assert_close(oa[idx]["exp_avg_sq"], ob[idx]["exp_avg_sq"], rtol=0, atol=1e-9)
    assert math.isfinite(straight.model.final_metrics.get("val/acc", float("nan")))


def test_load_weights_rejects_mismatched_checkpoint(tmp_path):
    model = Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE))
    other = Transformer(TransformerConfig(**dict(TINY, n_layers=3), attention="dense"))
    torch.save({"state_dict": {f"model.{k}": v for k, v in other.state_dict().items()}}, tmp_path / "x.ckpt")
    with pytest.raises(RuntimeError, match="does not match"):
        load_weights(model, str(tmp_path / "x.ckpt"))
    assert st.collect_selector_losses(model).item() == 0.0


def test_load_from_checkpoint_with_torchs_default_weights_only_unpickler(tmp_path):
    """``SparseLMModule.load_from_checkpoint`` with torch's default (weights-only) unpickler: the config among
    the hyperparameters is allowlisted, so the standard Lightning call rebuilds the module and its weights (it
    raised UnpicklingError on every checkpoint before)."""
    from lightning.pytorch import Trainer

    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE), lr=3e-4)
    trainer = Trainer(
        max_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "m.ckpt") == []  # the config: allowed
    loaded = SparseLMModule.load_from_checkpoint(tmp_path / "m.ckpt")
    assert loaded.hparams.model == module.hparams.model and loaded.hparams.lr == 3e-4
    for (name, a), (_, b) in zip(module.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_fork_point_branches_resume_the_uninterrupted_run_exactly(tmp_path):
    """A run stopped by ForkPoint after 2 steps and resumed from its checkpoint to 4 steps equals 4
    steps straight (weights and optimizer state): same data position, same learning-rate schedule (the
    checkpoint keeps max_steps=4, not 2). Bad arguments raise."""
    from lightning.pytorch import Trainer

    from sparse_train.lightning import ForkPoint

    def fit(callbacks, ckpt_path=None):
        torch.manual_seed(0)
        module = SparseLMModule(
            TransformerConfig(**TINY, attention="sparse", sparse=dict(SPARSE, dense_warmup_steps=1)), warmup_steps=1
        )
        dm = RetrievalDataModule(
            seq_len=128, num_pairs=2, num_queries=2, num_keys=4, num_values=8, batch_size=2, val_samples=2
        )
        trainer = Trainer(
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            accelerator="cpu",
            callbacks=callbacks,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, dm, ckpt_path=ckpt_path, weights_only=False)  # our own file: hparams hold a config
        return module, trainer

    straight, _ = fit([])
    fork = tmp_path / "fork" / "at2.ckpt"
    stopped, trainer = fit([ForkPoint(2, str(fork))])
    assert trainer.global_step == 2
    saved = torch.load(fork, weights_only=False)
    assert saved["global_step"] == 2
    resumed, trainer = fit([], ckpt_path=str(fork))
    assert trainer.global_step == 4
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), f"the branch diverged at {key}"
    assert not torch.equal(stopped.model.embed.weight, resumed.model.embed.weight)  # the branch did train on
    with pytest.raises(ValueError, match="ForkPoint.step"):
        ForkPoint(0, "x.ckpt")
    with pytest.raises(ValueError, match="ForkPoint.path"):
        ForkPoint(3, "")


def test_resume_names_the_arguments_the_checkpoint_replaces(tmp_path, monkeypatch):
    """LightningCLI takes the model's arguments from --ckpt_path's stored hyperparameters; a value given
    for the resumed run that the checkpoint replaces is named in a warning (not dropped silently), and
    an unchanged resume warns nothing."""
    monkeypatch.chdir(tmp_path)
    cli.run_cli(_stage_args("retrieval", tmp_path / "a", 1, _ckpt_cb(tmp_path / "ckpt")))
    resume = [f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}"]
    stored = yaml.safe_load(Path(cli.resolve_recipe("retrieval")).read_text())["model"]["init_args"]["model"]["sparse"]
    warmup = stored["dense_warmup_steps"]  # the recipe's value, stored in the checkpoint
    with pytest.warns(UserWarning, match=rf"model\.sparse\.dense_warmup_steps: 7 -> {warmup}; lr: 0\.5 -> "):
        cli.run_cli(
            _stage_args(
                "retrieval",
                tmp_path / "b",
                2,
                [*resume, "--model.init_args.model.sparse.dense_warmup_steps=7", "--model.init_args.lr=0.5"],
            )
        )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.run_cli(_stage_args("retrieval", tmp_path / "c", 2, resume))
    assert not [w for w in caught if "--ckpt_path" in str(w.message)]
