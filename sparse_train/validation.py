"""Argument checks: every rule about a single argument is written once, here.

The small named validators (`check_int`, `check_qkv`, `check_seq_lens`, `check_dropout`, ...) give a bad
argument the same ``ValueError`` (naming the argument and its value) on every path. This module is the
bottom layer: it imports nothing from the package. The checks that need the package's types compose these:
the block index's (``index.block_index.check_block_index``, ``check_inputs``), the plan's
(``plan.plan.check_plan``), the kernel options' (``options.normalize_kernel_options``) and the one call each
attention backend makes (``arguments.check_attention_args``).

Cost: every check reads shapes, dtypes, devices and Python scalars only, except the range check of
``seq_lens`` values, which is one host sync per call (a reduction over B elements). It is skipped while
``torch.compile`` traces (a data-dependent branch would break the graph); the kernel launchers clamp
``seq_lens`` to ``[0, N]`` on the device, so an unchecked value can never make a kernel read outside q/k/v.
Derived state is checked by cheap identity: a `BlockPlan` must come from the index it is used with, and
from its current contents (tensor version counters; skipped while compiling).

Domains defined here: dropout seeds are ints in ``[0, 2**64)`` (the 64-bit Philox key, two 32-bit
words); dropout_p is a float in ``[0, 1)``; block sizes, seq_len, capacity are ints >= 1; window,
sinks, r0 are ints >= 0; seq_lens values lie in ``[0, N]``; document ids are ``[B, N]``, non-negative,
non-decreasing along N and below 2**31 (the kernels read them as int32).

``document_ids`` values are checked under the same flag as ``seq_lens`` values (one more host sync,
skipped while compiling). They only ever decide masks, never addresses: an unchecked bad value can
give a wrong mask but never an out-of-bounds read.
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
import weakref
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DROPOUT_SEED_LIMIT",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "check_keys",
    "check_capacity",
    "compiling",
    "check_dropout",
    "check_dropout_p",
    "check_dropout_seed",
    "check_document_ids",
    "check_geometry",
    "check_integer_tensor",
    "check_qkv",
    "check_r0",
    "check_scale",
    "check_seq_lens",
    "check_window_sinks",
    "draw_dropout_seed",
    "index_versions",
    "plan_source",
    "source_is_current",
]

DROPOUT_SEED_LIMIT = 1 << 64
"""Dropout seeds are ints in ``[0, DROPOUT_SEED_LIMIT)``: the Philox4x32 key is two 32-bit words."""

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def compiling() -> bool:
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------- scalars
# Each check raises a ValueError whose message starts with the argument's label (``top_k``,
# ``SparseAttentionConfig.top_k``, ``SparseLMModule.lr``) and ends with the offending value; ValueError
# for wrong types too (one exception type for every rejected value, as the configs document).
def _got(value, wrong_type: bool) -> str:
    # The type is named when it is the problem: 1.0 and True print like valid ints to a casual reader.
    return f"got {value!r} ({type(value).__name__})" if wrong_type else f"got {value!r}"


def check_int(
    label: str, value, *, minimum: int | None = None, maximum: int | None = None, optional: bool = False
) -> int | None:
    """``value`` as a Python int (numpy ints accepted; bool, float and str rejected) in
    ``[minimum, maximum]``, or None when ``optional``."""
    if optional and value is None:
        return None
    if minimum == 1 and maximum is None:
        domain = "a positive int"
    else:
        bounds = ([f">= {minimum}"] if minimum is not None else []) + ([f"<= {maximum}"] if maximum is not None else [])
        domain = " ".join(["an int", " and ".join(bounds)]).strip()
    domain += " or None" if optional else ""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise ValueError(f"{label} must be {domain}, {_got(value, True)}")
    if not isinstance(value, torch.SymInt):
        value = operator.index(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{label} must be {domain}, {_got(value, False)}")
    return value


def check_float(
    label: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: float | None = None,
    exclusive_maximum: float | None = None,
    finite: bool = True,
    optional: bool = False,
) -> float | None:
    """``value`` as a float: a real number (bool excluded), finite unless ``finite=False``, within the
    given bounds (``minimum``/``maximum`` inclusive, ``exclusive_*`` strict), or None when ``optional``."""
    if optional and value is None:
        return None
    low = high = None
    if minimum is not None or exclusive_minimum is not None:
        low = f"[{minimum:g}" if minimum is not None else f"({exclusive_minimum:g}"
    if maximum is not None or exclusive_maximum is not None:
        high = f"{maximum:g}]" if maximum is not None else f"{exclusive_maximum:g})"
    if low and high:
        domain = f" in {low}, {high}"
    elif low:
        domain = f" {'>=' if minimum is not None else '>'} {low[1:]}"
    elif high:
        domain = f" {'<=' if maximum is not None else '<'} {high[:-1]}"
    else:
        domain = ""
    domain = ("a finite number" if finite else "a number") + domain + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{label} must be {domain}, {_got(value, True)}")
    value = float(value)
    # NaN fails every comparison, so each bound is written as "inside" and negated.
    outside = (
        (finite and not math.isfinite(value))
        or math.isnan(value)
        or (minimum is not None and not value >= minimum)
        or (maximum is not None and not value <= maximum)
        or (exclusive_minimum is not None and not value > exclusive_minimum)
        or (exclusive_maximum is not None and not value < exclusive_maximum)
    )
    if outside:
        raise ValueError(f"{label} must be {domain}, {_got(value, False)}")
    return value


def check_bool(label: str, value) -> bool:
    """``value`` is a bool (not 0/1, not a string such as ``"false"``, which is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{label} must be a bool, {_got(value, True)}")
    return value


def check_choice(label: str, value, choices):
    """``value`` is one of ``choices`` (compared with type, so 1 never matches True)."""
    if not any(isinstance(value, type(c)) and value == c for c in choices):
        raise ValueError(f"{label} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_keys(label: str, mapping, allowed) -> None:
    """``mapping`` is a dict whose keys are all in ``allowed``; an unknown key is named together with
    the closest allowed key and the full list."""
    allowed = list(allowed)
    if not isinstance(mapping, dict):
        raise ValueError(f"{label} must be a dict with keys among {', '.join(allowed)}, {_got(mapping, True)}")
    for key in mapping:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{label} has no key {key!r}{hint}; allowed keys: {', '.join(allowed)}")


def _as_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def check_geometry(seq_len, block_q, block_k) -> tuple[int, int, int]:
    """seq_len (N), block_q (BQ), block_k (BK): ints >= 1."""
    return (
        check_int("seq_len", seq_len, minimum=1),
        check_int("block_q", block_q, minimum=1),
        check_int("block_k", block_k, minimum=1),
    )


def check_window_sinks(window, sinks) -> tuple[int, int]:
    for value in (window, sinks):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"window and sinks must be ints >= 0, got window={window!r}, sinks={sinks!r}")
    return operator.index(window), operator.index(sinks)


def check_capacity(capacity, num_k_blocks: int) -> int | None:
    """None (automatic tier) or an int >= 1, clamped to NKB: a row never holds more than NKB distinct
    blocks, so a larger capacity would only be -1 padding (and a huge one an allocator crash); the
    automatic tier (`capacity_tier`) has the same cap."""
    if capacity is None:
        return None
    return min(check_int("capacity", capacity, minimum=1), max(1, num_k_blocks))


def check_r0(r0) -> int | None:
    return None if r0 is None else check_int("r0", r0, minimum=0)


def check_scale(scale, head_dim: int) -> float:
    """None -> ``1 / sqrt(D)``; otherwise a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = _as_real("scale", scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return value


def check_dropout_p(dropout_p) -> float:
    value = _as_real("dropout_p", dropout_p)
    if not (0.0 <= value < 1.0):
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p!r}")
    return value


def check_dropout_seed(dropout_seed) -> int | None:
    """None or an int in ``[0, 2**64)``; both backends derive the same Philox key from it."""
    if dropout_seed is None:
        return None
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, numbers.Integral):
        raise ValueError(
            f"dropout_seed must be an int in [0, 2**64), got {dropout_seed!r} ({type(dropout_seed).__name__})"
        )
    seed = operator.index(dropout_seed)
    if not (0 <= seed < DROPOUT_SEED_LIMIT):
        raise ValueError(f"dropout_seed must lie in [0, 2**64), got {seed}")
    return seed


def draw_dropout_seed() -> int:
    """A fresh dropout seed from torch's global CPU generator (so ``torch.manual_seed`` makes runs
    reproducible), within the seed domain; drawn below 2**62 so it also fits a signed int64."""
    return int(torch.randint(0, 2**62, (1,)).item())


def check_dropout(dropout_p, dropout_seed) -> tuple[float, int | None]:
    return check_dropout_p(dropout_p), check_dropout_seed(dropout_seed)


# ---------------------------------------------------------------------------------------- tensors
def check_integer_tensor(name: str, value, *, dim: int | None = None) -> Tensor:
    """A tensor of an integer dtype (not bool, not floating: a float would be truncated silently)."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"{name} must have an integer dtype, got {value.dtype}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    return value


def check_qkv(q, k, v, *, device=None) -> tuple[int, int, int, int, int]:
    """q ``[B, HQ, N, D]``, k/v ``[B, HKV, N, D]``: floating point, one dtype, one device (``device``,
    the block index's, when given), HQ a positive multiple of HKV, D >= 1. Returns (B, HQ, HKV, N, D).
    Any strides."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, N, D], got {getattr(t, 'shape', type(t))}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must have a floating-point dtype, got {t.dtype}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the block index is on {device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    bq, hq, nq, dq = q.shape
    bk, hkv, nk, dk = k.shape
    if bq != bk or nq != nk or dq != dk:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, length or head dim "
            "(expected q [B, HQ, N, D], k/v [B, HKV, N, D])"
        )
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv})")
    if dq == 0:
        raise ValueError(f"head dim must be >= 1, got q of shape {tuple(q.shape)}")
    return bq, hq, hkv, nq, dq


def check_seq_lens(seq_lens, batch: int, seq_len: int, device, *, values: bool = True) -> None:
    """Optional int ``[B]`` on ``device`` with values in ``[0, N]``. ``values=False`` skips the range
    check, the only host sync of the validation (also skipped while torch.compile traces)."""
    if seq_lens is None:
        return
    if not isinstance(seq_lens, Tensor) or seq_lens.dtype not in _INTEGER_DTYPES or seq_lens.dim() != 1:
        raise ValueError(
            "seq_lens must be a 1-D integer tensor [B], got "
            f"{getattr(seq_lens, 'dtype', type(seq_lens).__name__)} {tuple(getattr(seq_lens, 'shape', ()))}"
        )
    if seq_lens.numel() != batch:
        raise ValueError(f"seq_lens has {seq_lens.numel()} entries for batch {batch}")
    if seq_lens.device != torch.device(device):
        raise ValueError(f"seq_lens is on {seq_lens.device} but q is on {device}")
    if values and not compiling():
        bad = (seq_lens < 0) | (seq_lens > seq_len)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"seq_lens values must lie in [0, N={seq_len}], got seq_lens[{first}] = {int(seq_lens[first])}"
            )


_INT32_MAX = 2**31 - 1


def check_document_ids(document_ids, batch: int, seq_len: int, device, *, values: bool = True) -> None:
    """Optional document ids of packed rows (:mod:`sparse_train.documents`): an integer tensor ``[B, N]``
    (int32 or int64, any strides) on ``device``, values in ``[0, 2**31)``, non-decreasing along N in
    every row. ``values=False`` skips the value checks (one host sync; also skipped while
    torch.compile traces)."""
    if document_ids is None:
        return
    if not isinstance(document_ids, Tensor):
        raise ValueError(f"document_ids must be a torch.Tensor [B, N], got {type(document_ids).__name__}")
    if document_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"document_ids must be int32 or int64, got {document_ids.dtype}")
    if tuple(document_ids.shape) != (batch, seq_len):
        raise ValueError(f"document_ids must have shape [B, N] = [{batch}, {seq_len}], got {tuple(document_ids.shape)}")
    if document_ids.device != torch.device(device):
        raise ValueError(f"document_ids is on {document_ids.device} but q is on {device}")
    if not values or compiling() or document_ids.numel() == 0:
        return
    out_of_range = (document_ids < 0) | (document_ids > _INT32_MAX)
    decreasing = document_ids[:, 1:] < document_ids[:, :-1]
    if not bool(out_of_range.any() | decreasing.any()):
        return
    if bool(out_of_range.any()):
        b, t = (int(x) for x in out_of_range.nonzero()[0])
        raise ValueError(
            f"document_ids values must lie in [0, 2**31), got document_ids[{b}, {t}] = {int(document_ids[b, t])}"
        )
    b, t = (int(x) for x in decreasing.nonzero()[0])
    raise ValueError(
        f"document_ids must be non-decreasing along N, got row {b}: document_ids[{b}, {t + 1}] = "
        f"{int(document_ids[b, t + 1])} < document_ids[{b}, {t}] = {int(document_ids[b, t])}"
    )


class PlanSource(NamedTuple):
    """What a plan remembers of the index it was built from."""

    indices: weakref.ref
    counts: weakref.ref
    versions: tuple
    """Version counters of indices and counts (an in-place write bumps them; None for inference
    tensors, which have none). A CUDA-graph replay writes without bumping them: see
    `BlockIndex.from_canonical`."""
    shape: tuple
    geometry: tuple
    """(seq_len, block_q, block_k)."""


def index_versions(index) -> tuple:
    return tuple(None if t.is_inference() else t._version for t in (index.indices, index.counts))


def _dead_ref() -> None:
    return None


def plan_source(index) -> PlanSource:
    """What a plan built now from ``index`` remembers of it. While torch.compile traces, only the
    shape and geometry (dynamo traces neither weak references nor version counters): such a source is
    never current (:func:`source_is_current`), and `check_plan` checks only shapes while compiling."""
    shape, geometry = tuple(index.indices.shape), (index.seq_len, index.block_q, index.block_k)
    if compiling():
        return PlanSource(_dead_ref, _dead_ref, (), shape, geometry)
    return PlanSource(weakref.ref(index.indices), weakref.ref(index.counts), index_versions(index), shape, geometry)


def source_is_current(source: PlanSource, index) -> bool:
    """The index tensors are the ones ``source`` was taken from, unmodified since."""
    return (
        source.indices() is index.indices
        and source.counts() is index.counts
        and source.versions == index_versions(index)
    )
