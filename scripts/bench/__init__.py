"""Benchmarks: every one builds its inputs with :mod:`scripts.bench.inputs` and times with
:mod:`scripts.bench.harness` (repeat loops over :mod:`sparse_train.timing`'s stamps)."""
