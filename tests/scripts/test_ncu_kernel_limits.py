"""scripts/tools/ncu_kernel_limits.py's CPU half: Nsight Compute's raw CSV read into one summary row per kernel
(the profiling itself needs the GPU)."""

import json

import pytest

from scripts.tools import ncu_kernel_limits as limits

HEADER = [
    '"ID"',
    '"Kernel Name"',
    '"gpu__time_duration.sum"',
    '"sm__throughput.avg.pct_of_peak_sustained_elapsed"',
    '"dram__throughput.avg.pct_of_peak_sustained_elapsed"',
    '"launch__registers_per_thread"',
    '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"',
    '"smsp__average_warp_latency_per_inst_issued.ratio"',
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"',
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"',
    '"smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"',
    '"smsp__average_warps_issue_stalled_barrier_not_issued_per_issue_active.ratio"',
    '"gpc__cycles_elapsed.avg.per_second"',
]
UNITS = [
    '""',
    '""',
    '"nsecond"',
    '"%"',
    '"%"',
    '"register/thread"',
    '"%"',
    '"cycle"',
    '"warp"',
    '"warp"',
    '"warp"',
    '"warp"',
    '"hz"',
]


def raw_csv(*rows):
    lines = ["==PROF== Connected to process 1", "profiled one forward + backward", ",".join(HEADER), ",".join(UNITS)]
    lines += [",".join(f'"{cell}"' for cell in row) for row in rows]
    return "\n".join(lines) + "\n"


def test_summary_rows_in_launch_order():
    text = raw_csv(
        [
            "0",
            "_dkdv_gluon_kernel(int, float)",
            "5,580,123",
            "61.5",
            "12.0",
            "168",
            "55.2",
            "8.0",
            "3.0",
            "1.0",
            "2.0",
            "0.5",
            "1,730,000,000",
        ],
        ["1", "_dkdv_finish_kernel", "95,000", "5.0", "40.0", "255", "0", "4.0", "0", "3.0", "0", "0", "1,980,000,000"],
    )
    first, second = limits.summarize(text)
    assert first["kernel"] == "_dkdv_gluon_kernel" and first["time_ms"] == pytest.approx(5.580123)
    assert first["registers_per_thread"] == 168 and first["sm_mhz"] == pytest.approx(1730.0)
    assert first["tensor_pipe_pct"] == 55.2 and first["cycles_between_issues"] == 8.0
    # shares of ncu's 8 cycles between issues, largest first; the "not issued" variant is not a reason of its own
    assert list(first["top_stalls"]) == ["barrier", "math_pipe_throttle", "long_scoreboard"]
    assert first["top_stalls"]["barrier"] == pytest.approx(3 / 8)
    assert second["top_stalls"] == {"long_scoreboard": pytest.approx(0.75)}
    table = limits.markdown([first, second])
    assert (
        "| `_dkdv_gluon_kernel` | 5.580 | 1730 | 62 | 55 | - | 12 | - | - | 168 | barrier 38%, math_pipe_throttle 25%, "
        in table
    )
    json.dumps([first, second])


def test_missing_table_is_an_error():
    with pytest.raises(ValueError, match="no ncu raw CSV"):
        limits.summarize("==PROF== no kernels were profiled\n")
