"""Per-step timing and attention metrics, logged through the Lightning logger; :class:`ForkPoint`
(a checkpoint at a given step, then stop) for experiments that branch one run into several.

Phases of one optimisation step under Lightning's automatic optimisation, delimited by its hooks:

    on_train_batch_start -> training_step (forward + loss) -> on_before_backward -> backward
    -> on_after_backward -> on_before_optimizer_step -> optimizer.step -> on_train_batch_end

Marks come from :class:`sparse_train.timing.Marks`: CUDA events on GPU (recorded on the current
stream and read after the step's end event has completed, so the host does not stall between phases)
and ``time.perf_counter`` on CPU, where kernels run synchronously and the wall clock is the device clock.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

import sparse_train as st

from ..timing import Marks
from ..validation import check_bool, check_int

__all__ = [
    "ForkPoint",
    "StepTimer",
    "StepRichProgressBar",
    "StepTQDMProgressBar",
    "step_progress_bar",
    "step_description",
]


class StepTimer(Callback):
    """Logs forward/backward/optimizer time, tokens/s and the attention breakdown every few steps.

    Logged keys (``time/*`` in milliseconds):
    ``time/forward_ms``, ``time/backward_ms``, ``time/optimizer_ms``, ``time/step_ms``,
    ``throughput/tokens_per_s`` (this device, step time only), ``throughput/tokens_per_s_global``
    (all devices), ``throughput/tokens_per_s_wall`` (this device, including data loading and logging),
    ``memory/peak_allocated_gib`` (on CUDA: this device's peak of allocated memory since the start), and the means of
    ``st.collect_attention_stats`` under ``attn/``: ``attn/density``,
    ``attn/fallbacks/<reason>``, ``attn/selector_loss``, ``attn/recall`` and, when the sparse config has
    ``profile: true``, ``attn/time/selector_ms``, ``attn/time/plan_ms``, ``attn/time/attn_fwd_ms``,
    ``attn/time/attn_bwd_ms`` (with activation checkpointing also ``attn/time/<phase>_recompute_ms``).

    Args:
        every_n_steps: Measure every n-th training batch (on GPU each measured step waits for the
            device once at its end).
        attention_stats: Also log ``st.collect_attention_stats`` of the model.
        prog_bar: Show tokens/s in the progress bar.
    """

    def __init__(self, every_n_steps: int = 1, attention_stats: bool = True, prog_bar: bool = True) -> None:
        super().__init__()
        check_int("StepTimer.every_n_steps", every_n_steps, minimum=1)
        check_bool("StepTimer.attention_stats", attention_stats)
        check_bool("StepTimer.prog_bar", prog_bar)
        self.every_n_steps = every_n_steps
        self.attention_stats = attention_stats
        self.prog_bar = prog_bar
        self._marks = Marks()
        self._active = False
        self._tokens = 0
        self._last_start: float | None = None
        self._wall_tokens = 0
        self.last_metrics: dict[str, float] = {}

    def _mark(self, name: str) -> None:
        if self._active:
            self._marks.mark(name)

    def _elapsed_ms(self, a: str, b: str) -> float:
        ms = self._marks.ms(a, b)
        return 0.0 if ms is None else ms

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        tokens = batch["tokens"].numel() if isinstance(batch, dict) and "tokens" in batch else 0
        self._wall_interval = (now - self._last_start) if self._last_start is not None else None
        self._wall_tokens_prev, self._wall_tokens = self._wall_tokens, tokens
        self._last_start = now
        self._active = batch_idx % self.every_n_steps == 0
        self._marks = Marks(pl_module.device)
        self._tokens = tokens
        self._mark("start")

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._mark("forward_end")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark("backward_end")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._mark("optimizer_start")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._mark("end")
        step_ms = self._elapsed_ms("start", "end")
        metrics = {
            "time/forward_ms": self._elapsed_ms("start", "forward_end"),
            "time/backward_ms": self._elapsed_ms("forward_end", "backward_end"),
            "time/optimizer_ms": self._elapsed_ms("optimizer_start", "end"),
            "time/step_ms": step_ms,
        }
        if self._tokens and step_ms > 0:
            tps = self._tokens / (step_ms / 1e3)
            metrics["throughput/tokens_per_s"] = tps
            metrics["throughput/tokens_per_s_global"] = tps * trainer.world_size
        if self._wall_interval and self._wall_tokens_prev:
            metrics["throughput/tokens_per_s_wall"] = self._wall_tokens_prev / self._wall_interval
        if pl_module.device.type == "cuda":
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
        if self.attention_stats:
            for key, value in st.collect_attention_stats(pl_module).items():
                metrics[f"attn/{key}"] = float(value)
        self.last_metrics = metrics
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        if self.prog_bar and "throughput/tokens_per_s" in metrics:
            pl_module.log(
                "tok/s",
                metrics["throughput/tokens_per_s"],
                prog_bar=True,
                logger=False,
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )


def step_description(trainer: Trainer) -> str | None:
    """``"step s/max_steps"`` for a run bounded by ``trainer.max_steps``, else None (epoch-based runs
    keep Lightning's ``Epoch e``). Lightning's own label reads ``Epoch 0/-2`` there: ``max_epochs`` is -1."""
    max_steps = trainer.max_steps
    if max_steps is None or max_steps <= 0:
        return None
    return f"step {trainer.global_step}/{max_steps}"


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar, labelled ``step s/max_steps`` when the run is step-based."""

    def _get_train_description(self, current_epoch: int) -> str:
        text = step_description(self.trainer)
        if text is None:
            return super()._get_train_description(current_epoch)
        return f"{text:{len(self.validation_description)}}"  # padded like Lightning's, so the bar does not jump

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar_id = self.train_progress_bar_id
        if step_description(trainer) is not None and self.progress is not None and bar_id is not None:
            text = self._get_train_description(trainer.current_epoch)
            style = self.theme.description
            self.progress.update(bar_id, description=f"[{style}]{text}" if style else text)


class StepTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar, labelled ``step s/max_steps`` when the run is step-based."""

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        text = step_description(trainer)
        if text is not None:
            self.train_progress_bar.set_description(text)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        text = step_description(trainer)
        if text is not None and self.train_progress_bar is not None:
            self.train_progress_bar.set_description(text, refresh=False)


def step_progress_bar() -> ProgressBar:
    """The step-labelled variant of the bar Lightning would pick itself (rich when installed, else tqdm)."""
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()


class ForkPoint(Callback):
    """Save a full checkpoint (model, selectors, optimizer, scheduler, loop) after ``step`` optimizer
    steps and stop the run there; every ``fit --ckpt_path <path>`` then continues the same run.

    It turns an A/B into a branch from one shared state. Two training runs of one config and seed on a
    GPU drift apart (nondeterministic kernels, amplified over a thousand steps; measured on the 16K
    retrieval recipe: up to 0.08 val/acc between runs that were still training identically), which
    hides effects of a few points. Branches from one checkpoint differ only after the fork. The
    learning-rate schedule is the one of the full run (``max_steps`` stays as configured).

    Args:
        step: Optimizer steps (``trainer.global_step``) after which to save and stop; >= 1.
        path: Checkpoint file to write (its directory is created).

    Raises:
        ValueError: ``step`` not a positive int, ``path`` not a non-empty string.
    """

    def __init__(self, step: int, path: str) -> None:
        super().__init__()
        check_int("ForkPoint.step", step, minimum=1)
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"ForkPoint.path must be a checkpoint file path, got {path!r}")
        self.step = step
        self.path = str(path)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step < self.step:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        trainer.save_checkpoint(self.path)
        trainer.should_stop = True
