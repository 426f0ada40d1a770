"""Argument checks shared by the config dataclasses and the Lightning constructors.

Each check raises a ``ValueError`` whose message starts with the argument's label (for example
``SparseAttentionConfig.top_k`` or ``SparseLMModule.lr``) and ends with the offending value, so a bad
recipe value fails at start-up with the name to fix, not deep inside a training step as a
``TypeError``, ``ZeroDivisionError`` or NaN loss. ``ValueError`` for wrong types too: the config's
documented contract is one exception type for every rejected value.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Collection, Iterable, Optional

__all__ = ["check_int", "check_float", "check_bool", "check_choice", "check_keys"]


def _got(value: Any, wrong_type: bool) -> str:
    # The type is named when it is the problem: 1.0 and True print like valid ints to a casual reader.
    return f"got {value!r} ({type(value).__name__})" if wrong_type else f"got {value!r}"


def check_int(label: str, value: Any, *, minimum: Optional[int] = None, maximum: Optional[int] = None,
              optional: bool = False) -> None:
    """``value`` is an int (bool excluded) in ``[minimum, maximum]``, or None when ``optional``."""
    if optional and value is None:
        return
    if minimum == 1 and maximum is None:
        domain = "a positive int"
    else:
        bounds = ([f">= {minimum}"] if minimum is not None else []) + ([f"<= {maximum}"] if maximum is not None else [])
        domain = " ".join(["an int", " and ".join(bounds)]).strip()
    domain += " or None" if optional else ""
    wrong_type = not isinstance(value, int) or isinstance(value, bool)
    if wrong_type or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{label} must be {domain}, {_got(value, wrong_type)}")


def check_float(label: str, value: Any, *, minimum: Optional[float] = None, maximum: Optional[float] = None,
                exclusive_minimum: Optional[float] = None, exclusive_maximum: Optional[float] = None,
                finite: bool = True, optional: bool = False) -> None:
    """``value`` is a real number (int or float, bool excluded), finite unless ``finite=False``, within
    the given bounds (``minimum``/``maximum`` inclusive, ``exclusive_*`` strict, as in JSON Schema), or
    None when ``optional``."""
    if optional and value is None:
        return
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
    wrong_type = not isinstance(value, (int, float)) or isinstance(value, bool)
    if wrong_type:
        raise ValueError(f"{label} must be {domain}, {_got(value, True)}")
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


def check_bool(label: str, value: Any) -> None:
    """``value`` is a bool (not 0/1, not a string such as ``"false"``, which is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{label} must be a bool, {_got(value, True)}")


def check_choice(label: str, value: Any, choices: Collection[Any]) -> None:
    """``value`` is one of ``choices``."""
    if not any(isinstance(value, type(c)) and value == c for c in choices):
        raise ValueError(f"{label} must be one of {tuple(choices)}, got {value!r}")


def check_keys(label: str, mapping: Any, allowed: Iterable[str]) -> None:
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
