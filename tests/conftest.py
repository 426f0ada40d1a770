"""Test configuration. Without a CUDA device, Triton kernels run through the interpreter, which must be
switched on before any ``@triton.jit`` function is decorated, i.e. before sparse_train's kernel modules
are imported; conftest runs first, so this is the place. Also: undoing the interpreter's leaked patches of
``triton.language`` after each test, the hypothesis profiles, the ``gpu``
marker's skip without CUDA, and the NaN-poisoning fixture of the kernel tests. Input builders are in
``builders.py``."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and not HAS_CUDA:
    # one worker per core (README: ``-n 2``); torch's own threads would make each worker fight the other
    torch.set_num_threads(1)


def _triton_language_namespaces() -> list:
    """The objects whose attributes Triton's interpreter replaces while it runs a kernel (``_patch_lang``)."""
    try:
        import triton.language as tl
    except ImportError:
        return []
    return [tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base]


# Triton 3.6's interpreter patches triton.language's builtins for each call of a @triton.jit helper
# (``InterpretedFunction.__call__``) and never restores them; a helper whose module sees ``triton.language.core``
# (tl.max, tl.sum, ... from triton.language.standard) leaves ``triton.language.core.add`` & co. bound to the
# interpreter. A later real compile (the Gluon kernels' compile-only tests for sm_90a) then builds ``a + b`` with
# the interpreter's semantics and fails ("block_argument has no attribute get_element_ty"), but only when the
# kernel is not in Triton's disk cache yet, i.e. on a fresh machine. The import-time attributes are put back
# after every test.
_LANGUAGE_SNAPSHOT = [(ns, dict(vars(ns))) for ns in _triton_language_namespaces()]


@pytest.fixture(autouse=True)
def _undo_leaked_interpreter_patches():
    yield
    for namespace, original in _LANGUAGE_SNAPSHOT:
        for name, value in list(vars(namespace).items()):
            if name in original and original[name] is not value:
                setattr(namespace, name, original[name])


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # property tests skip themselves without hypothesis
    settings = None
if settings is not None:
    # Property tests (tests/test_properties.py) run a fixed, derandomized set of examples so CI is
    # reproducible and bounded; no example database is written. HYPOTHESIS_PROFILE=explore searches
    # fresh random examples locally (each test keeps its own max_examples).
    settings.register_profile(
        "ci",
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile(
        "explore",
        derandomize=False,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def poison_fresh_outputs(monkeypatch):
    """While the test runs, every floating-point tensor made by ``torch.empty`` comes filled with NaN, so
    an element a kernel leaves unwritten in a fresh output (or workspace) shows up as NaN instead of
    stale memory. Test modules of the kernels use it for every test (``pytestmark``)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def small_kv_chunks(request, monkeypatch):
    """Chunk KV rows after 2 query blocks, so the chunked KV-centric dK/dV path (partials + ordered
    finish) runs on the interpreter's tiny shapes; GPU-marked tests keep the default chunk. Kernel test
    modules use it for every test (``pytestmark``)."""
    if request.node.get_closest_marker("gpu") is None:
        from sparse_train.plan import tuning

        monkeypatch.setattr(tuning, "KV_CHUNK", 2)
