"""The benchmarks' shared pieces on the CPU: the timing harness's repeat loop and statistics (scripts/bench/harness.py)
and the input builders (scripts/bench/inputs.py)."""

import statistics
import time

import pytest
import torch

from scripts.bench import harness, inputs


@pytest.mark.parametrize("count", [1, 2, 7, 20], ids=lambda c: f"{c}-samples")
def test_quantile_matches_torch(count):
    values = torch.rand(count, generator=torch.Generator().manual_seed(count), dtype=torch.float64)
    samples = values.tolist()
    for q in (0.0, 0.5, 0.95, 1.0):
        assert harness.quantile(samples, q) == pytest.approx(float(values.quantile(q)), abs=1e-12)
    timing = harness.summarize(samples)
    assert timing.repeats == count and timing.min_ms == min(samples)
    assert timing.median_ms == pytest.approx(statistics.median(samples), abs=1e-12)


def test_measure_counts_warmup_and_repeats():
    calls = []
    timing = harness.measure(lambda: calls.append(1), device="cpu", warmup=3, min_reps=4, max_reps=4)
    assert len(calls) == 3 + 4 and timing.repeats == 4 and 0.0 <= timing.min_ms <= timing.median_ms


def test_measure_runs_until_the_budget():
    timing = harness.measure(lambda: time.sleep(0.005), device="cpu", warmup=0, min_reps=2, max_reps=50, budget_ms=40.0)
    # each repeat takes at least 5 ms: the budget is reached after at most 8 repeats, and not before 2
    assert 2 <= timing.repeats <= 8 and timing.min_ms >= 4.9


def test_benchmark_inputs_are_seeded():
    q, k, v, do = inputs.benchmark_inputs(
        96, 16, seed=5, batch=2, heads=4, kv_heads=2, dtype=torch.float32, device="cpu", requires_grad=True
    )
    assert q.shape == do.shape == (2, 4, 96, 16) and k.shape == v.shape == (2, 2, 96, 16)
    assert q.requires_grad and k.requires_grad and v.requires_grad and not do.requires_grad
    again = inputs.benchmark_inputs(96, 16, seed=5, batch=2, heads=4, kv_heads=2, dtype=torch.float32, device="cpu")
    other = inputs.benchmark_inputs(96, 16, seed=6, batch=2, heads=4, kv_heads=2, dtype=torch.float32, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, do), again))
    assert not torch.equal(q, other[0])


@pytest.mark.parametrize("n,name", [(1000, "P64"), (300, "P128")], ids=["1000-P64", "300-P128"])
def test_random_selection_is_causal_distinct_and_seeded(n, name):
    pattern = inputs.PATTERNS[name]
    sel = inputs.random_selection(n, pattern, seed=3, device="cpu", batch=2, kv_heads=3)
    nqb = -(-n // pattern["block"])
    assert sel.dtype == torch.int32 and sel.shape == (2, 3, nqb, min(pattern["topk"], nqb))
    assert torch.equal(sel, inputs.random_selection(n, pattern, seed=3, device="cpu", batch=2, kv_heads=3))
    for i in range(nqb):
        row = sel[:, :, i]
        causal = min(i + 1, sel.shape[-1])  # key blocks 0..i are causal for query block i (BQ = BK)
        assert ((row >= 0).sum(-1) == causal).all()
        valid = row[:, :, :causal]
        assert (valid <= i).all() and (valid >= 0).all()
        assert all(len(set(r.tolist())) == causal for r in valid.reshape(-1, causal))
    idx, _ = inputs.build_index(sel, n, pattern)  # the union with the window and the sinks
    assert idx.seq_len == n and (idx.counts >= (sel >= 0).sum(-1)).all()


def test_benchmark_tokens_are_seeded_and_in_range():
    tokens = inputs.benchmark_tokens(50, 7, seed=2, device="cpu")
    assert tokens.shape == (1, 51) and tokens.dtype == torch.int64
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 7
    assert torch.equal(tokens, inputs.benchmark_tokens(50, 7, seed=2, device="cpu"))
