"""Fault tolerance of a Lightning fit: a ``sparse-train fit`` process killed with SIGKILL in the middle of a step and
resumed with ``--ckpt_path last`` ends with the weights, optimizer and scheduler state, per-step selections and logged
values of the uninterrupted run, bitwise (CPU, ``--trainer.deterministic=true``)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import sparse_train as st
from sparse_train import cli

MAX_STEPS = 8
KILLED_AFTER = 3  # steps 0-2 done and checkpointed (global_step 3); the process dies inside step 3

# A callback of the killed process only: it announces (marker file) that it is inside step ``step`` (after the
# backward, before the optimizer step, so the module's counters have advanced in memory) and waits to be killed.
STALL = textwrap.dedent(
    """
    import time
    from pathlib import Path

    from lightning.pytorch import Callback


    class StallBeforeOptimizerStep(Callback):
        def __init__(self, step: int, marker: str) -> None:
            self.step, self.marker = step, marker

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == self.step:
                Path(self.marker).touch()
                time.sleep(600)
    """
)

UNLOGGED = ("time/", "throughput/", "tok/s", "memory/", "attn/fallbacks/", "attn/replay/")
"""Logged keys left out of the comparison: timings, and counts that are statistics of the process's module objects."""


def _args(root: Path, checkpoints: Path, extra: list[str] = ()) -> list[str]:
    # Steps 0-1 at 64 tokens (the warm-up, then a full selection: the hysteresis enters the dense path), steps 2-4 at
    # 96 (a selected fraction between the hysteresis thresholds: the dense path holds, also in the resumed run's
    # first steps), steps 5-7 at 128 (sparse). Blocks of 16; 2 of the 4 to 8 query blocks are distilled per step.
    return [
        "fit",
        "--config",
        "retrieval",
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.deterministic=true",
        f"--trainer.max_steps={MAX_STEPS}",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--logger_backend=csv",
        f"--trainer.default_root_dir={root}",
        "--data.init_args.seq_len=128",
        "--data.init_args.batch_size=1",
        "--data.init_args.curriculum=[{steps: 2, seq_len: 64, batch_size: 1}, {steps: 3, seq_len: 96, batch_size: 1}]",
        "--data.init_args.val_samples=2",
        "--data.init_args.eval_batch_size=2",
        "--model.init_args.model.d_model=32",
        "--model.init_args.model.n_layers=1",
        "--model.init_args.model.sparse.block_q=16",
        "--model.init_args.model.sparse.block_k=16",
        "--model.init_args.model.sparse.top_k=2",
        "--model.init_args.model.sparse.dense_warmup_steps=1",
        "--model.init_args.model.sparse.distill_query_blocks=2",
        "--model.init_args.model.sparse.metrics_every=3",
        "--model.init_args.model.sparse.metrics_query_blocks=2",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={checkpoints}",
        "--trainer.callbacks.filename={step}",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.every_n_train_steps=1",
        *extra,
    ]


def _logged(root: Path) -> dict[int, dict[str, str]]:
    """step -> logged key -> value as written to the CSV (the exact float's repr), without :data:`UNLOGGED`."""
    (path,) = root.glob("logs/version_*/metrics.csv")
    rows: dict[int, dict[str, str]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            values = {k: v for k, v in row.items() if v != "" and k not in ("step", "epoch")}
            rows.setdefault(int(row["step"]), {}).update(
                {k: v for k, v in values.items() if not k.startswith(UNLOGGED)}
            )
    return rows


@pytest.fixture
def selections(monkeypatch):
    """Every training forward's (sequence length, selection or None on the dense path) of every SparseAttention, in
    call order; Lightning's deterministic mode is switched back off afterwards."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # Lightning sets it; restored at teardown
    deterministic = torch.are_deterministic_algorithms_enabled()
    calls: list[tuple[int, torch.Tensor | None]] = []
    forward = st.SparseAttention.forward

    def recorded(self, q, *args, **kwargs):
        out = forward(self, q, *args, **kwargs)
        if self.training:
            selection = self.last_selection
            calls.append((q.shape[2], None if selection is None else selection.indices.clone()))
        return out

    monkeypatch.setattr(st.SparseAttention, "forward", recorded)
    yield calls
    torch.use_deterministic_algorithms(deterministic)


def test_fit_killed_mid_step_and_resumed_from_last_equals_the_uninterrupted_run(tmp_path, monkeypatch, selections):
    """``sparse-train fit --config retrieval`` (shrunk: 8 steps of a length curriculum 64 -> 96 -> 128, a checkpoint
    every step) runs straight in this process; the same command in a subprocess is killed with SIGKILL inside step 3
    (0-based, after its backward) and resumed here with ``--ckpt_path last`` from the checkpoint written after steps
    0-2. The resumed run
    takes the straight run's path (warm-up, dense hysteresis, sparse) and selection at every step and ends with its
    weights, buffers, optimizer and scheduler state, and every loss and metric it logs from step 3 on (validation
    included), bitwise."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stall.py").write_text(STALL)
    marker = tmp_path / "stalled"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(st.__file__).parents[1]), str(tmp_path)]))
    killed_args = _args(
        tmp_path / "killed",
        tmp_path / "checkpoints",
        [
            "--trainer.callbacks+=stall.StallBeforeOptimizerStep",
            f"--trainer.callbacks.step={KILLED_AFTER}",
            f"--trainer.callbacks.marker={marker}",
        ],
    )
    log = tmp_path / "killed.log"
    with open(log, "w") as stderr:
        victim = subprocess.Popen(
            [sys.executable, "-m", "sparse_train.cli", *killed_args], env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        straight = cli.run_cli(_args(tmp_path / "straight", tmp_path / "straight_checkpoints"))
        straight_calls = list(selections)
        selections.clear()
        deadline = time.monotonic() + 120
        while not marker.exists() and victim.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the run never reached step {KILLED_AFTER}: {log.read_text()[-3000:]}"
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=60) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == KILLED_AFTER
    assert not (tmp_path / "checkpoints" / f"step={KILLED_AFTER + 1}.ckpt").exists()

    resumed = cli.run_cli(_args(tmp_path / "resumed", tmp_path / "checkpoints", ["--ckpt_path=last"]))

    assert resumed.trainer.global_step == straight.trainer.global_step == MAX_STEPS
    # the path each step took (dense warm-up and hysteresis, then sparse) and the selection it attended with
    layers = len([m for m in straight.model.modules() if isinstance(m, st.SparseAttention)])
    want_calls = straight_calls[KILLED_AFTER * layers :]
    assert [n for n, _ in straight_calls[::layers]] == [64] * 2 + [96] * 3 + [128] * 3
    assert [s is None for _, s in straight_calls[::layers]] == [True] * 5 + [False] * 3
    assert len(selections) == len(want_calls)
    for call, ((n, got), (want_n, want)) in enumerate(zip(selections, want_calls)):
        assert n == want_n and (got is None) == (want is None), f"call {call}: {n} tokens, dense {got is None}"
        assert got is None or torch.equal(got, want), f"call {call}: the selection differs"
    # weights, buffers, optimizer and scheduler state
    want_state, got_state = straight.model.state_dict(), resumed.model.state_dict()
    assert want_state.keys() == got_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), f"weights: {key}"
    want_opt = straight.trainer.optimizers[0].state_dict()
    got_opt = resumed.trainer.optimizers[0].state_dict()
    for index, state in want_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(got_opt["state"][index][name], value), f"optimizer state {index}.{name}"
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert (
        resumed.trainer.lr_scheduler_configs[0].scheduler.state_dict()
        == straight.trainer.lr_scheduler_configs[0].scheduler.state_dict()
    )
    # every logged loss and metric of the resumed steps, validation included
    want_logs, got_logs = _logged(tmp_path / "straight"), _logged(tmp_path / "resumed")
    assert sorted(got_logs) == [step for step in sorted(want_logs) if step >= KILLED_AFTER]
    for step, logged in got_logs.items():
        assert logged == want_logs[step], f"step {step}"
    assert any("train/selector_loss" in logged for logged in got_logs.values())
    assert any("attn/mass_recall_mean" in logged for logged in got_logs.values())
    assert any("val/loss" in logged for logged in got_logs.values())
