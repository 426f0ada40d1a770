"""The benchmarks' shared option values: ``--candidates`` parses as ``SparseAttentionConfig.selector_candidates``
takes it, and the selector benchmark's selector options default to the module's."""

import argparse

import pytest

import sparse_train as st
from scripts.bench import selector as bench_selector
from scripts.bench.inputs import candidates_argument


@pytest.mark.parametrize(
    ("text", "value"),
    [("auto", "auto"), ("none", None), ("1", 1), ("32", 32)],
    ids=["auto", "none", "one", "thirty-two"],
)
def test_candidates_argument_parses(text, value):
    assert candidates_argument(text) == value


@pytest.mark.parametrize("text", ["0", "-4", "many", "", "None"], ids=["zero", "negative", "word", "empty", "capital"])
def test_candidates_argument_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="'auto', 'none' or a count"):
        candidates_argument(text)


def test_selector_benchmark_defaults_are_the_modules():
    args = bench_selector.parse_args(["--out", "unused.json"])
    cfg = st.SparseAttentionConfig()
    assert (args.selector, args.selector_distill, args.candidates) == (
        cfg.selector,
        cfg.selector_distill,
        cfg.selector_candidates,
    )
