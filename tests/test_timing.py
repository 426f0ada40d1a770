"""The one timing helper (sparse_train.timing) behind the module's profile, StepTimer and bench_step."""

from __future__ import annotations

import time

import pytest
import torch

from sparse_train.timing import Marks, PhaseTimer, elapsed_ms, stamp


def test_cpu_marks_measure_wall_time_and_report_missing_marks():
    marks = Marks("cpu")
    marks.mark("start")
    time.sleep(0.02)
    marks.mark("end")
    assert 15.0 <= marks.ms("start", "end") < 2000.0
    assert marks.ms("start", "never") is None and marks.ms("never", "end") is None
    assert isinstance(stamp("cpu"), float) and elapsed_ms(1.0, 1.5) == pytest.approx(500.0)


def test_phase_timer_reports_only_complete_phases():
    timer = PhaseTimer()
    timer.mark("selector", 0, torch.device("cpu"))
    timer.mark("selector", 1, torch.device("cpu"))
    timer.mark("attn_bwd", 0, torch.device("cpu"))  # the backward never ran
    out = timer.elapsed_ms()
    assert set(out) == {"time/selector_ms"} and out["time/selector_ms"] >= 0.0


@pytest.mark.gpu
def test_cuda_marks_are_events_read_after_completion():
    marks = Marks("cuda")
    marks.mark("start")
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(10):
        x = x @ x.T / 2048
    marks.mark("end")
    assert isinstance(marks.stamps["end"], torch.cuda.Event)
    assert marks.ms("start", "end") > 0.0
