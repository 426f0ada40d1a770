"""The repository's maintained benchmarks (``scripts/bench``) and tools (``scripts/tools``).

Not part of the installed package: run them as modules from the repository root, e.g.
``python -m scripts.bench.attention --help``; they import one another as ``scripts.<sub>.<name>``.
"""
