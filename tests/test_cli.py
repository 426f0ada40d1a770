"""The ``sparse-train`` CLI: a bad override is reported in one line naming the key
(and what it accepts), with a non-zero exit and no traceback; errors raised while training keep their
traceback; ``SPARSE_TRAIN_DEBUG=1`` shows the traceback of the short ones; no warning about ``args`` on
every run; step-based runs label the progress bar ``step s/max_steps``. The failure paths stop before
training (or the run is built with ``run=False``), so each takes about a second in-process; the console
runs take a few seconds each."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_train import cli
from sparse_train.lightning import SparseLMModule, StepRichProgressBar, StepTQDMProgressBar, TransformerConfig
from sparse_train.lightning.callbacks import step_description
from sparse_train.lightning.data import RetrievalDataModule

REPO = Path(__file__).resolve().parents[1]
# Small enough that a run that gets past parsing builds in well under a second.
TINY = [
    "--model.init_args.model.d_model=32",
    "--data.init_args.seq_len=128",
    "--data.init_args.curriculum=[]",
    "--data.init_args.batch_size=2",
    "--data.init_args.val_samples=2",
    "--data.init_args.eval_batch_size=2",
    "--trainer.accelerator=cpu",
    "--logger_backend=none",
]


def _error_of(args: list[str]) -> str:
    with pytest.raises(SystemExit) as exc_info:
        cli.run_cli(["fit", "--config", "retrieval", *TINY, *args])
    message = exc_info.value.code
    assert isinstance(message, str), f"exit code {message!r} instead of a message"
    return message


@pytest.mark.parametrize(
    "override,expected",
    [
        pytest.param(
            "--model.init_args.model.sparse.top_kk=8",
            "TransformerConfig.sparse has no key 'top_kk' (did you mean 'top_k'?); allowed keys: block_q, "
            "block_k, top_k,",
            id="unknown-sparse-key",
        ),
        pytest.param(
            "--model.init_args.model.sparse.top_k=-1",
            "SparseAttentionConfig.top_k must be an int >= 0, got -1",
            id="invalid-sparse-value",
        ),
        pytest.param(
            "--model.init_args.model.sparse.top_k=abc",
            "SparseAttentionConfig.top_k must be an int >= 0, got 'abc' (str)",
            id="wrong-type-sparse-value",
        ),
        pytest.param(
            "--model.init_args.model.sparse.scale=.nan",
            "SparseAttentionConfig.scale must be a finite number > 0 or None, got nan",
            id="nan-sparse-scale",
        ),
        pytest.param("--model.init_args.lr=abc", "--model.init_args.lr: expected float, got abc", id="wrong-type-lr"),
        pytest.param(
            "--model.init_args.model.attention=flash",
            "--model.init_args.model.attention: expected one of 'sparse', 'dense', got flash",
            id="invalid-literal",
        ),
        pytest.param(
            "--model.init_args.model.d_modell=64",
            "--model: unknown key 'd_modell' in SparseLMModule.model (did you mean 'd_model'?); allowed keys: "
            "vocab_size, d_model,",
            id="unknown-model-key",
        ),
        pytest.param(
            "--data.init_args.seq_lenn=64",
            "--data: unknown key 'seq_lenn' in RetrievalDataModule (did you mean 'seq_len'?)",
            id="unknown-data-key",
        ),
        pytest.param(
            "--trainer.max_stepz=3",
            "unknown option --trainer.max_stepz (did you mean --trainer.max_steps?)",
            id="unknown-trainer-key",
        ),
        pytest.param(
            "--model.init_args.model.n_heads=0",
            "TransformerConfig.n_heads must be a positive int, got 0",
            id="zero-heads-was-ZeroDivisionError",
        ),
        pytest.param(
            "--data.init_args.batch_size=0",
            "RetrievalDataModule.batch_size must be a positive int, got 0",
            id="zero-batch-was-IndexError",
        ),
        pytest.param(
            "--model.init_args.model.vocab_size=10",
            "data needs vocab_size >= 70 but model.vocab_size = 10; set --model.init_args.model.vocab_size=70",
            id="vocab-too-small-was-raised-mid-fit",
        ),
        pytest.param(
            "--logger_backend=cloud",
            "--logger_backend must be one of ('auto', 'csv', 'wandb', 'none'), got 'cloud'",
            id="unknown-logger-backend",
        ),
    ],
)
def test_bad_override_is_one_line_naming_the_key(override, expected):
    message = _error_of([override])
    first, *rest = message.splitlines()
    assert first.startswith("sparse-train fit: error: "), message
    assert expected in first, message
    assert len(rest) == 1 and "SPARSE_TRAIN_DEBUG=1" in rest[0], message
    assert "Traceback" not in message and "Namespace(" not in message


@pytest.mark.parametrize(
    "override,marker",
    [
        pytest.param("--model.init_args.model.sparse.top_kk=8", "has no key 'top_kk'", id="config-error"),
        pytest.param("--trainer.max_stepz=3", "unknown option --trainer.max_stepz", id="argument-error"),
    ],
)
def test_console_run_prints_two_lines_and_exits_non_zero(override, marker, tmp_path):
    """What a user sees: the whole stderr+stdout of the process is two lines."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPARSE_TRAIN_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "sparse_train.cli", "fit", "--config", "retrieval", override],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0
    assert len(output) == 2, "\n".join(output)
    assert marker in output[0] and "Traceback" not in proc.stderr


def test_debug_env_shows_the_traceback(monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(argparse.ArgumentError, match="unrecognized arguments: --trainer.max_stepz"):
        cli.run_cli(["fit", "--config", "retrieval", *TINY, "--trainer.max_stepz=3"])
    with pytest.raises(ValueError) as exc_info:
        cli.run_cli(["fit", "--config", "retrieval", *TINY, "--model.init_args.model.sparse.top_k=-1"])
    causes = []
    ex = exc_info.value
    while ex is not None:
        causes.append(str(ex))
        ex = ex.__cause__
    assert any("SparseAttentionConfig.top_k must be an int >= 0" in c for c in causes)


def test_errors_while_training_keep_their_traceback(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def broken_step(self, batch, batch_idx):
        raise RuntimeError("boom inside training_step")

    monkeypatch.setattr(SparseLMModule, "training_step", broken_step)
    with pytest.raises(RuntimeError, match="boom inside training_step"):
        cli.run_cli(["fit", "--config", "retrieval", *TINY, "--trainer.max_steps=1"])


def test_step_based_run_labels_the_bar_and_does_not_warn_about_args(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparse_train.cli",
            "fit",
            "--config",
            "retrieval",
            *TINY,
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "step 2/2" in output, output
    assert "Epoch 0/-2" not in output
    assert "LightningCLI's args parameter" not in output
    assert "Seed set to 0" in output  # held back during instantiation, then logged


@pytest.mark.parametrize("bar_class", [StepRichProgressBar, StepTQDMProgressBar], ids=["rich", "tqdm"])
def test_progress_bars_describe_steps(bar_class, tmp_path):
    from lightning.pytorch import Callback, Trainer

    seen: list[str] = []

    class ReadLabel(Callback):  # runs after the bar's own hook (callbacks keep their order)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if isinstance(bar, StepRichProgressBar):
                seen.append(str(bar.progress.tasks[bar.train_progress_bar_id].description))
            else:
                seen.append(bar.train_progress_bar.desc)

    module = SparseLMModule(
        TransformerConfig(vocab_size=70, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, attention="dense")
    )
    data = RetrievalDataModule(seq_len=64, num_pairs=2, num_queries=2, num_keys=4, batch_size=2, val_samples=2)
    bar = bar_class()
    trainer = Trainer(
        max_steps=3,
        callbacks=[bar, ReadLabel()],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    # rich keeps the theme's style markup ("[...]") in front, tqdm appends ": "
    assert [label.split("]")[-1].strip().rstrip(":") for label in seen] == ["step 1/3", "step 2/3", "step 3/3"]


def test_epoch_based_run_keeps_lightnings_label():
    from lightning.pytorch import Trainer

    assert step_description(Trainer(max_epochs=2, logger=False, enable_checkpointing=False)) is None


def test_cli_installs_the_step_bar_unless_one_is_configured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    built = cli.run_cli(["--config", "retrieval", *TINY], run=False)
    assert isinstance(built.trainer.progress_bar_callback, (StepRichProgressBar, StepTQDMProgressBar))
    own = cli.run_cli(
        ["--config", "retrieval", *TINY, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], run=False
    )
    assert type(own.trainer.progress_bar_callback).__name__ == "TQDMProgressBar"
    off = cli.run_cli(["--config", "retrieval", *TINY, "--trainer.enable_progress_bar=false"], run=False)
    assert off.trainer.progress_bar_callback is None


def test_short_config_flag_takes_a_recipe_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    built = cli.run_cli(["-c", "retrieval", *TINY], run=False)
    assert built.model.model_config.d_model == 32 and built.datamodule.hparams.seq_len == 128
    assert torch.is_tensor(next(iter(built.datamodule.val_dataloader()))["tokens"])


@pytest.mark.parametrize(
    "root_flag,expected",
    [
        pytest.param([], "runs/retrieval", id="recipe-root"),
        pytest.param(["--trainer.default_root_dir=null"], "runs/retrieval", id="unset-root-is-runs-recipe-not-cwd"),
        pytest.param(["--trainer.default_root_dir=elsewhere/run1"], "elsewhere/run1", id="flag-root"),
    ],
)
def test_default_loggers_write_under_the_trainers_root(root_flag, expected, tmp_path, monkeypatch):
    """The CSV metrics and the offline W&B run directory (``<root>/wandb``) go under the trainer's
    default_root_dir, never the working directory. wandb need not be installed: a stand-in records the
    directory the W&B logger is given."""
    import lightning.pytorch.loggers as loggers

    given: list[str] = []

    class RecordingWandb(loggers.CSVLogger):
        def __init__(self, save_dir, project, name, offline):
            assert offline is True
            given.append(save_dir)
            super().__init__(save_dir=save_dir, name="wandb_stand_in")

    monkeypatch.setattr(loggers, "WandbLogger", RecordingWandb)
    monkeypatch.chdir(tmp_path)
    built = cli.run_cli(["--config", "retrieval", *TINY, "--logger_backend=wandb", *root_flag], run=False)
    trainer = built.trainer
    root = os.path.abspath(expected)
    assert os.path.abspath(trainer.default_root_dir) == root
    assert [os.path.abspath(d) for d in given] == [root]
    assert [os.path.abspath(lg.save_dir) for lg in trainer.loggers] == [root, root]
    assert type(trainer.loggers[0]).__name__ == "CSVLogger"  # first: checkpoints sit next to metrics.csv
