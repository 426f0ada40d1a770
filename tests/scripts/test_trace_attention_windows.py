"""scripts/tools/trace_attention_windows.py on a hand-made Chrome trace: how a timeline of kernels is cut into
attention windows (kernel time, idle time inside, the gap before). The real traces come from the GPU."""

import gzip
import json

import pytest

from scripts.tools import trace_attention_windows as windows_script


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


# two layers' backward: a long matmul, an idle gap, delta / fill / dQ / dK-dV with 30 us idle inside, then the
# next layer's matmul; a forward window in between; CPU ops and a short foreign kernel after the last of ours
TIMELINE = [
    kernel("nvjet_matmul_dgrad", 0, 1000),
    kernel("_delta_kernel", 1200, 100),  # 200 us idle before
    kernel("_kv_schedule_kernel", 1300, 60),  # ours, though longer than a foreign kernel may be
    kernel("vectorized_fill_kernel", 1360, 10),
    kernel("_dq_gluon_kernel", 1400, 2000),  # 30 us idle inside
    kernel("_dkdv_gluon_kernel", 3400, 4000),
    kernel("elementwise_cast", 7400, 5),  # short, after the last of ours: not in the window
    kernel("nvjet_matmul_dgrad", 7460, 1000),
    kernel("_fwd_gluon_kernel", 8460, 1500),  # forward window, no gap
    kernel("_delta_kernel", 9960, 100),  # backward right after a forward: a new window
    kernel("_dq_kernel", 10060, 1000),
    kernel("_dkdv_kernel", 11060, 2000),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 50, "dur": 900},
]


@pytest.mark.parametrize("compressed", [False, True], ids=["json", "json.gz"])
def test_windows_split_kernel_and_idle_time(tmp_path, compressed):
    path = tmp_path / ("trace.json.gz" if compressed else "trace.json")
    opener = gzip.open if compressed else open
    with opener(path, "wt") as f:
        json.dump({"traceEvents": TIMELINE[::-1]}, f)  # out of order on purpose: the script sorts by start
    rows = windows_script.windows(windows_script.load_kernels(str(path)))
    assert [r["kind"] for r in rows] == ["backward", "forward", "backward"]
    first, fwd, second = rows
    assert first["span_ms"] == pytest.approx(6.2) and first["kernel_ms"] == pytest.approx(6.17)
    assert first["idle_ms"] == pytest.approx(0.03) and first["gap_before_ms"] == pytest.approx(0.2)
    assert first["num_kernels"] == 5 and first["previous_kernel"] == "nvjet_matmul_dgrad"
    assert fwd["span_ms"] == pytest.approx(1.5) and fwd["gap_before_ms"] == 0.0
    assert second["kernel_ms"] == pytest.approx(3.1) and second["idle_ms"] == 0.0
    summary = windows_script.summarize(rows)
    assert summary["backward"]["windows"] == 2
    assert summary["backward"]["median_span_ms"] == pytest.approx((6.2 + 3.1) / 2)
    # per kernel, the median over the windows that ran it: the Gluon dQ ran in the first window only
    assert summary["backward"]["median_ms_per_kernel"]["_dq_gluon_kernel"] == pytest.approx(2.0)
    assert summary["backward"]["median_ms_per_kernel"]["_delta_kernel"] == pytest.approx(0.1)


def test_main_writes_the_windows(tmp_path, capsys):
    path, out = tmp_path / "trace.json", tmp_path / "windows.json"
    path.write_text(json.dumps(TIMELINE))  # a bare event list is a valid Chrome trace too
    windows_script.main([str(path), "--out", str(out)])
    written = json.loads(out.read_text())
    assert len(written["windows"]) == 3 and set(written["summary"]) == {"forward", "backward"}
    assert "backward: 2 windows" in capsys.readouterr().out
