"""The CPU parts of the attention benchmark (scripts/bench/attention.py) and its timing harness: the packed-documents
mode's argument parsing and inputs (document ids, the pruned selection, the valid-pair count, the Flex BlockMask,
checked by the script's own ``dry_run``), the report writer, and the nvidia-smi sampler. The timings themselves need
the GPU."""

import argparse
import json
import shutil
import time

import pytest
import torch

from scripts.bench import attention as bench
from scripts.bench import harness
from scripts.bench.inputs import B, packed_document_ids


@pytest.mark.parametrize("text,expected", [("2048:16384", (2048, 16384)), ("7:7", (7, 7))], ids=["range", "fixed"])
def test_parse_packed(text, expected):
    assert bench.parse_packed(text) == expected


@pytest.mark.parametrize(
    "text", ["16384:2048", "0:5", "2048", "a:b", "1:2:3"], ids=["reversed", "zero", "one-number", "not-ints", "three"]
)
def test_parse_packed_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--packed"):
        bench.parse_packed(text)


def test_packed_document_ids_are_seeded_and_cover_n():
    ids, lengths = packed_document_ids(1000, 40, 300, seed=3, device="cpu")
    again, _ = packed_document_ids(1000, 40, 300, seed=3, device="cpu")
    assert torch.equal(ids, again) and ids.dtype == torch.int32 and ids.shape == (B, 1000)
    assert sum(lengths) == 1000 and all(40 <= n <= 300 for n in lengths[:-1])
    assert int(ids[0, -1]) == len(lengths) - 1


@pytest.mark.parametrize(
    "n,pattern,packed", [(333, "P64", (20, 150)), (517, "P128", (1, 90))], ids=["odd333-P64", "odd517-P128-short-docs"]
)
def test_dry_run(n, pattern, packed):
    (row,) = bench.dry_run([n], [pattern], packed)
    assert row["N"] == n and 0 < row["kept_blocks"] < row["blocks"] and row["valid_pairs"] > 0


def test_packed_report(tmp_path):
    ours = dict(
        kind="ours_packed",
        N=8192,
        pattern="P64",
        documents=3,
        density=0.1,
        valid_pair_fraction=0.4,
        fwd_ms=1.0,
        fwd_p95_ms=1.1,
        bwd_ms=2.0,
        bwd_p95_ms=2.2,
        fwdbwd_ms=3.0,
        fwdbwd_p95_ms=3.3,
        det_fwdbwd_ms=3.5,
        nodocs_fwd_ms=0.9,
        nodocs_fwdbwd_ms=2.8,
        fwd_TFLOPs=100.0,
        fwd_frac_ceiling=0.12,
    )
    flex = dict(kind="flex_packed", N=8192, pattern="P64", fwd_ms=2.0, fwd_p95_ms=2.1, fwdbwd_ms=6.0, fwdbwd_p95_ms=6.1)
    results = dict(
        gpu="test",
        torch="x",
        triton="y",
        date="today",
        rows=[ours, flex],
        packed=(2048, 16384),
        ceilings={"copy_TBps": 4.0, "bf16_matmul_TFLOPs": 785.0},
    )
    bench.write_outputs(results, str(tmp_path))
    stem = tmp_path / f"{bench.OUTPUT_STEM}_packed"
    text = (stem.with_suffix(".md")).read_text()
    assert "| 8192 | P64 | 3 | 0.1000 | 0.400 | 1.000 (1.100) |" in text and "| 0.50x | 0.50x |" in text
    assert json.loads(stem.with_suffix(".json").read_text())["packed"] == [2048, 16384]


def test_report_has_the_backward_modes_table(tmp_path):
    """The main table compares with Flex and SDPA; the backward modes (deterministic, fused dQ, stored dS) and
    their memory have a table of their own, from the same rows."""
    ours = dict(
        kind="ours",
        N=65536,
        pattern="P64",
        density=0.05,
        index_plan_ms=1.0,
        fwd_ms=4.0,
        bwd_ms=13.0,
        fwdbwd_ms=17.0,
        det_bwd_ms=13.5,
        det_fwdbwd_ms=17.5,
        fused_bwd_ms=18.0,
        fused_fwdbwd_ms=22.0,
        stored_bwd_ms=12.0,
        stored_fwdbwd_ms=16.0,
        fwdbwd_peak_extra_MB=1801.4,
        stored_fwdbwd_peak_extra_MB=9993.4,
        fwd_TFLOPs=400.0,
        fwd_frac_ceiling=0.5,
        bwd_TFLOPs=300.0,
        bwd_frac_ceiling=0.38,
    )
    flex = dict(kind="flex", N=65536, pattern="P64", fwd_ms=6.0, fwdbwd_ms=24.0)
    results = dict(
        gpu="test",
        torch="x",
        triton="y",
        date="today",
        rows=[ours, flex],
        ceilings={"copy_TBps": 4.0, "bf16_matmul_TFLOPs": 790.0},
    )
    bench.write_outputs(results, str(tmp_path))
    text = (tmp_path / f"{bench.OUTPUT_STEM}.md").read_text()
    assert "| 65536 | P64 | 0.0500 | 1.000 | 4.000 | 13.000 | 17.000 | 400 (50%) | 300 (38%) | 6.000 | 24.000 |" in text
    assert (
        "| 65536 | P64 | 13.000 | 17.000 | 13.500 | 17.500 | 18.000 | 22.000 | 12.000 | 16.000 | 1801 / 9993 |" in text
    )


def test_report_has_the_cuda_graph_table(tmp_path):
    """Rows with CUDA-graph replay times get a table of their own: ours against Flex and cuDNN replayed alike, and
    the share of the matmul ceiling (3.5x the forward's FLOPs in the graphed forward + backward)."""
    ours = dict(
        kind="ours",
        N=65536,
        pattern="P128",
        density=0.05,
        index_plan_ms=1.0,
        fwd_ms=4.0,
        bwd_ms=12.0,
        fwdbwd_ms=16.0,
        fwd_TFLOPs=400.0,
        fwd_frac_ceiling=0.5,
        bwd_TFLOPs=300.0,
        bwd_frac_ceiling=0.38,
        fwdbwd_graph_ms=14.0,
    )
    flex = dict(kind="flex", N=65536, pattern="P128", fwd_ms=4.4, fwdbwd_ms=22.7, fwdbwd_graph_ms=21.0)
    cudnn = dict(kind="dense_cudnn", N=65536, fwd_ms=58.0, fwdbwd_ms=218.0, fwdbwd_graph_ms=210.0)
    results = dict(
        gpu="test",
        torch="x",
        triton="y",
        date="today",
        rows=[ours, flex, cudnn],
        ceilings={"copy_TBps": 4.0, "bf16_matmul_TFLOPs": 800.0},
    )
    bench.write_outputs(results, str(tmp_path))
    text = (tmp_path / f"{bench.OUTPUT_STEM}.md").read_text()
    # 3.5 * 400 TFLOP/s * 4 ms = 5.6 TFLOP in 14 ms: 400 TFLOP/s, 50% of 800
    assert "| 65536 | P128 | 14.000 | 50% | 21.000 | 210.000 | 0.67x | 15.0x |" in text


def test_parse_smi_samples():
    text = "612.53, 1980\n[N/A], 1980\n700.10, 1755\n699.0"
    assert harness.parse_smi_samples(text) == [(612.53, 1980.0), (700.1, 1755.0)]


def test_report_has_the_sustained_table(tmp_path):
    """Rows timed back to back get a table of their own, set against the matmul ceiling held the same way, with
    the power and clock each implementation ran at."""
    ours = dict(
        kind="ours",
        N=65536,
        pattern="P128",
        density=0.05,
        index_plan_ms=1.0,
        fwd_ms=4.0,
        bwd_ms=12.0,
        fwdbwd_ms=16.0,
        fwd_TFLOPs=400.0,
        fwd_frac_ceiling=0.5,
        bwd_TFLOPs=300.0,
        bwd_frac_ceiling=0.38,
        fwdbwd_sustained_ms=20.0,
        fwdbwd_sustained_watts=690.4,
        fwdbwd_sustained_sm_mhz=1702.0,
    )
    flex = dict(
        kind="flex",
        N=65536,
        pattern="P128",
        fwd_ms=4.4,
        fwdbwd_ms=22.7,
        fwdbwd_sustained_ms=25.0,
        fwdbwd_sustained_watts=650.0,
        fwdbwd_sustained_sm_mhz=1800.0,
    )
    cudnn = dict(kind="dense_cudnn", N=65536, fwd_ms=58.0, fwdbwd_ms=218.0, fwdbwd_sustained_ms=300.0)
    results = dict(
        gpu="test",
        torch="x",
        triton="y",
        date="today",
        rows=[ours, flex, cudnn],
        ceilings={
            "copy_TBps": 4.0,
            "bf16_matmul_TFLOPs": 800.0,
            "bf16_matmul_sustained_TFLOPs": 700.0,
            "matmul_sustained_watts": 698.0,
            "matmul_sustained_sm_mhz": 1650.0,
        },
    )
    bench.write_outputs(results, str(tmp_path))
    text = (tmp_path / f"{bench.OUTPUT_STEM}.md").read_text()
    # 3.5 * 400 TFLOP/s * 4 ms = 5.6 TFLOP in 20 ms: 280 TFLOP/s, 40% of the 700 held
    assert "700 TFLOP/s at 698 W, 1650 MHz" in text
    assert "| 65536 | P128 | 20.000 | 40% | 690 / 1702 | 25.000 | 650 / 1800 | 300.000 | 0.80x | 15.0x |" in text


def test_smi_sampler_reads_nvidia_smi_and_tolerates_its_absence(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"  # prints two samples, then runs on until the sampler terminates it
    fake.write_text(f"#!/bin/sh\nprintf '650.0, 1900\\n701.5, 1710\\n'\nexec {shutil.which('sleep')} 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}")
    start = time.perf_counter()
    with harness.SmiSampler() as smi:
        time.sleep(0.5)
    assert time.perf_counter() - start < 10
    assert smi.samples == [(650.0, 1900.0), (701.5, 1710.0)]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with harness.SmiSampler() as smi:
        pass
    assert smi.samples == []
