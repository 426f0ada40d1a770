"""Constructor validation (issue 11, "Reliability"): every config field and every constructor argument of
the Lightning model, module, data and callback classes rejects NaN/inf floats, floats/bools/strings for
ints, negative or zero sizes and inconsistent shapes with a ValueError that names the argument and the
value, instead of a NaN loss, a ZeroDivisionError or a silent fallback to the default."""

from __future__ import annotations

import pytest

import sparse_train as st
from sparse_train._validation import check_float, check_int

NAN, INF = float("nan"), float("inf")

# Kept explicit (not derived from the annotations) so the test reads as the list of what is checked; the
# completeness test below fails when a field is added without being listed here.
CONFIG_INT_FIELDS = ["block_q", "block_k", "top_k", "window", "sinks", "selector_dim", "r0", "distill_every",
                     "distill_query_rows", "distill_query_blocks", "distill_chunk_mb", "metrics_every",
                     "metrics_query_blocks"]
CONFIG_FLOAT_FIELDS = ["dropout_p", "scale", "distill_weight", "dense_enter_density", "dense_exit_density"]
CONFIG_BOOL_FIELDS = ["deterministic", "replay", "dense_fallback", "profile"]
CONFIG_CHOICE_FIELDS = ["backend", "distill", "index_check"]


def test_config_field_lists_cover_every_field():
    listed = CONFIG_INT_FIELDS + CONFIG_FLOAT_FIELDS + CONFIG_BOOL_FIELDS + CONFIG_CHOICE_FIELDS
    assert sorted(listed) == sorted(st.SparseAttentionConfig.__dataclass_fields__)
    for name, f in st.SparseAttentionConfig.__dataclass_fields__.items():
        kind = str(f.type).split(" ")[0]
        expected = {"int": CONFIG_INT_FIELDS, "float": CONFIG_FLOAT_FIELDS, "bool": CONFIG_BOOL_FIELDS,
                    "str": CONFIG_CHOICE_FIELDS}[kind]
        assert name in expected, f"{name}: {f.type}"


def _raises_naming(exc_info, label: str, value) -> None:
    message = str(exc_info.value)
    assert label in message, message
    assert f"got {value!r}" in message, message


@pytest.mark.parametrize("field", CONFIG_INT_FIELDS)
@pytest.mark.parametrize(
    "value", [pytest.param(2.0, id="float"), pytest.param(True, id="bool"), pytest.param("2", id="str")]
)
def test_config_int_field_rejects_non_int(field, value):
    with pytest.raises(ValueError) as exc_info:
        st.SparseAttentionConfig(**{field: value})
    _raises_naming(exc_info, f"SparseAttentionConfig.{field} must be", value)


@pytest.mark.parametrize("field", CONFIG_FLOAT_FIELDS)
@pytest.mark.parametrize(
    "value",
    [pytest.param(NAN, id="nan"), pytest.param(INF, id="inf"), pytest.param(-INF, id="minus-inf"),
     pytest.param(True, id="bool"), pytest.param("0.5", id="str")],
)
def test_config_float_field_rejects_non_finite_and_non_numbers(field, value):
    with pytest.raises(ValueError) as exc_info:
        st.SparseAttentionConfig(**{field: value})
    message = str(exc_info.value)
    assert f"SparseAttentionConfig.{field}" in message and repr(value) in message, message


@pytest.mark.parametrize(
    "field,value,message",
    [
        pytest.param("scale", 0.0, "scale must be a finite number > 0 or None", id="scale-zero"),
        pytest.param("scale", -1.0, "scale must be a finite number > 0 or None", id="scale-negative"),
        pytest.param("distill_weight", -0.5, "distill_weight must be a finite number >= 0", id="distill-weight-negative"),
        pytest.param("dropout_p", -0.1, "dropout_p must be a finite number in [0, 1)", id="dropout-negative"),
        pytest.param("dense_enter_density", 1.5, "dense_enter_density must be a finite number in [0, 1]",
                     id="enter-density-above-one"),
        pytest.param("r0", -1, "r0 must be an int >= 0 or None", id="r0-negative"),
        pytest.param("distill_query_rows", 0, "distill_query_rows must be a positive int or None", id="rows-zero"),
        pytest.param("backend", None, "backend must be one of", id="backend-none"),
    ],
)
def test_config_rejects_out_of_domain_values(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        st.SparseAttentionConfig(**{field: value})


@pytest.mark.parametrize(
    "check,value,message",
    [
        pytest.param(lambda v: check_int("x.n", v, minimum=0, maximum=4), 5, "x.n must be an int >= 0 and <= 4, got 5",
                     id="int-above-maximum"),
        pytest.param(lambda v: check_int("x.n", v), None, "x.n must be an int, got None (NoneType)", id="int-none"),
        pytest.param(lambda v: check_float("x.f", v, minimum=0.0, finite=False), -INF,
                     "x.f must be a number >= 0, got -inf", id="float-not-finite-still-bounded"),
        pytest.param(lambda v: check_float("x.f", v, minimum=0.0, finite=False), NAN,
                     "x.f must be a number >= 0, got nan", id="float-nan-never-passes"),
    ],
)
def test_check_helpers_messages(check, value, message):
    with pytest.raises(ValueError) as exc_info:
        check(value)
    assert str(exc_info.value) == message


def test_valid_values_pass_unchanged():
    cfg = st.SparseAttentionConfig(scale=1, dropout_p=0, distill_weight=0, r0=None, distill_query_rows=64)
    assert cfg.scale == 1 and cfg.r0 is None
    check_float("x.f", INF, minimum=0.0, finite=False)
    check_int("x.n", 4, minimum=0, maximum=4)
