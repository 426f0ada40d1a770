"""Constructor validation: every config field and every constructor argument of
the Lightning model, module, data and callback classes rejects NaN/inf floats, floats/bools/strings for
ints, negative or zero sizes and inconsistent shapes with a ValueError that names the argument and the
value, instead of a NaN loss, a ZeroDivisionError or a silent fallback to the default."""

from __future__ import annotations

import pytest
import torch

import sparse_train as st
from sparse_train.lightning import (
    ByteLMDataModule,
    HFCausalLMModule,
    RetrievalDataModule,
    SparseLMModule,
    StepTimer,
    Transformer,
    TransformerConfig,
)
from sparse_train.lightning.data import CurriculumStage, RetrievalTask
from sparse_train.validation import check_float, check_int

NAN, INF = float("nan"), float("inf")

# Kept explicit (not derived from the annotations) so the test reads as the list of what is checked; the
# completeness test below fails when a field is added without being listed here.
CONFIG_INT_FIELDS = [
    "block_q",
    "block_k",
    "top_k",
    "window",
    "sinks",
    "selector_dim",
    "selector_index_heads",
    "selector_candidates",
    "distill_every",
    "distill_query_rows",
    "distill_query_blocks",
    "distill_chunk_mb",
    "metrics_every",
    "metrics_query_blocks",
    "dense_warmup_steps",
]
CONFIG_FLOAT_FIELDS = [
    "dropout_p",
    "scale",
    "distill_weight",
    "dense_enter_density",
    "dense_exit_density",
    "selector_lr_multiplier",
    "selector_rope_theta",
    "top_p",
]
CONFIG_BOOL_FIELDS = [
    "deterministic",
    "replay",
    "dense_fallback",
    "profile",
    "selector_distance_bias",
]
CONFIG_OPTIONS_FIELDS = ["kernel_options"]
CONFIG_CHOICE_FIELDS = [
    "backend",
    "distill",
    "index_check",
    "distill_row_pool",
    "distill_support",
    "key_pooling",
    "query_pooling",
    "selector",
    "selector_rope_style",
    "selector_distill",
]


def test_config_field_lists_cover_every_field():
    """A new field must be listed here (and get its one-line check in ``__post_init__``)."""
    listed = CONFIG_INT_FIELDS + CONFIG_FLOAT_FIELDS + CONFIG_BOOL_FIELDS + CONFIG_CHOICE_FIELDS + CONFIG_OPTIONS_FIELDS
    assert sorted(listed) == sorted(st.SparseAttentionConfig.__dataclass_fields__)
    lists = {
        "int": CONFIG_INT_FIELDS,
        "float": CONFIG_FLOAT_FIELDS,
        "bool": CONFIG_BOOL_FIELDS,
        "str": CONFIG_CHOICE_FIELDS,
        "KernelOptions": CONFIG_OPTIONS_FIELDS,
    }
    for name, f in st.SparseAttentionConfig.__dataclass_fields__.items():
        kind = str(f.type).split(" ")[0]  # "int | None" -> "int"
        assert name in lists.get(kind, []), f"{name} ({f.type}) is not in the list of its kind"


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
    [
        pytest.param(NAN, id="nan"),
        pytest.param(INF, id="inf"),
        pytest.param(-INF, id="minus-inf"),
        pytest.param(True, id="bool"),
        pytest.param("0.5", id="str"),
    ],
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
        pytest.param(
            "distill_weight", -0.5, "distill_weight must be a finite number >= 0", id="distill-weight-negative"
        ),
        pytest.param("dropout_p", -0.1, "dropout_p must be a finite number in [0, 1)", id="dropout-negative"),
        pytest.param(
            "dense_enter_density",
            1.5,
            "dense_enter_density must be a finite number in [0, 1]",
            id="enter-density-above-one",
        ),
        pytest.param(
            "kernel_options",
            {"r0": -1},
            "SparseAttentionConfig: kernel_options.r0 must be an int >= 0, got -1",
            id="kernel-options-r0-negative",
        ),
        pytest.param(
            "kernel_options",
            {"fused": True},
            "SparseAttentionConfig: kernel_options has no key 'fused'",
            id="kernel-options-unknown-key",
        ),
        pytest.param(
            "kernel_options", "fast", "kernel_options must be a sparse_train.KernelOptions", id="kernel-options-str"
        ),
        pytest.param("distill_query_rows", 0, "distill_query_rows must be a positive int or None", id="rows-zero"),
        pytest.param("backend", None, "backend must be one of", id="backend-none"),
    ],
)
def test_config_rejects_out_of_domain_values(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        st.SparseAttentionConfig(**{field: value})


def test_config_refuses_the_fused_backward_with_deterministic():
    with pytest.raises(ValueError, match="fused_dq sums dQ with atomics.*deterministic=True"):
        st.SparseAttentionConfig(kernel_options={"fused_dq": True}, deterministic=True)
    with pytest.raises(ValueError, match="fused_dq and kernel_options.stored_ds are two ways"):
        st.SparseAttentionConfig(kernel_options=st.KernelOptions(fused_dq=True, stored_ds=True))
    cfg = st.SparseAttentionConfig(kernel_options={"stored_ds": True}, deterministic=True)
    assert cfg.kernel_options == st.KernelOptions(stored_ds=True)


def test_config_kernel_options_refuse_a_plan():
    idx = st.BlockIndex.from_selection(torch.zeros(1, 1, 2, 1, dtype=torch.int32), seq_len=128, block_q=64, block_k=64)
    with pytest.raises(ValueError, match="kernel_options.plan is not a config choice"):
        st.SparseAttentionConfig(kernel_options={"plan": idx.plan()})


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(None, id="none"),
        pytest.param({"r0": 3, "kv_gluon": False}, id="dict"),
        pytest.param(st.KernelOptions(r0=2, fused_dq=True), id="typed"),
    ],
)
def test_config_kernel_options_round_trip_through_to_dict(options):
    cfg = st.SparseAttentionConfig(kernel_options=options)
    assert isinstance(cfg.kernel_options, st.KernelOptions)
    again = st.SparseAttentionConfig(**cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize(
    "overrides,message",
    [
        pytest.param(
            {"head_dim": 0},
            r"TransformerConfig\.head_dim must be a positive int or None, got 0",
            id="head-dim-zero-was-silently-default",
        ),
        pytest.param(
            {"n_heads": 0},
            r"TransformerConfig\.n_heads must be a positive int, got 0",
            id="n-heads-zero-was-ZeroDivisionError",
        ),
        pytest.param(
            {"n_kv_heads": 0},
            r"TransformerConfig\.n_kv_heads must be a positive int, got 0",
            id="n-kv-heads-zero-was-ZeroDivisionError",
        ),
        pytest.param(
            {"n_heads": 4, "n_kv_heads": 3},
            r"n_heads=4 must be a multiple of n_kv_heads=3",
            id="heads-not-multiple-of-kv-heads",
        ),
        pytest.param(
            {"d_model": 30}, r"TransformerConfig\.d_model=30 is not divisible by n_heads=4", id="d-model-not-divisible"
        ),
        pytest.param({"head_dim": 7}, r"head dim must be even for RoPE.*got 7", id="odd-head-dim"),
        pytest.param(
            {"n_layers": 1.5},
            r"TransformerConfig\.n_layers must be a positive int, got 1\.5 \(float\)",
            id="n-layers-float",
        ),
        pytest.param(
            {"n_heads": True},
            r"TransformerConfig\.n_heads must be a positive int, got True \(bool\)",
            id="n-heads-bool",
        ),
        pytest.param(
            {"vocab_size": 0}, r"TransformerConfig\.vocab_size must be a positive int, got 0", id="vocab-zero"
        ),
        pytest.param(
            {"ffn_hidden": 0},
            r"TransformerConfig\.ffn_hidden must be a positive int or None, got 0",
            id="ffn-hidden-zero-was-silently-default",
        ),
        pytest.param(
            {"rope_theta": NAN},
            r"TransformerConfig\.rope_theta must be a finite number > 0, got nan",
            id="rope-theta-nan",
        ),
        pytest.param(
            {"norm_eps": 0.0}, r"TransformerConfig\.norm_eps must be a finite number > 0, got 0\.0", id="norm-eps-zero"
        ),
        pytest.param(
            {"init_std": INF}, r"TransformerConfig\.init_std must be a finite number >= 0, got inf", id="init-std-inf"
        ),
        pytest.param(
            {"tie_embeddings": "no"},
            r"TransformerConfig\.tie_embeddings must be a bool, got 'no'",
            id="tie-embeddings-str",
        ),
        pytest.param(
            {"attention": "flash"},
            r"TransformerConfig\.attention must be one of \('sparse', 'dense'\)",
            id="attention-unknown",
        ),
        pytest.param(
            {"sparse": {"top_kk": 8}},
            r"TransformerConfig\.sparse has no key 'top_kk' \(did you mean 'top_k'\?\); allowed keys: block_q",
            id="sparse-unknown-key",
        ),
        pytest.param(
            {"sparse": {"top_k": -1}},
            r"SparseAttentionConfig\.top_k must be an int >= 0, got -1",
            id="sparse-bad-value-at-config-time",
        ),
        pytest.param({"sparse": 3}, r"TransformerConfig\.sparse must be a dict", id="sparse-not-a-dict"),
    ],
)
def test_transformer_config_rejects_bad_values(overrides, message):
    base = dict(vocab_size=70, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**base, **overrides})


def test_transformer_config_defaults_and_explicit_head_dim_still_build():
    model = Transformer(
        TransformerConfig(
            vocab_size=70, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, attention="dense"
        )
    )
    assert model.blocks[0].attn.head_dim == 16 and model.blocks[0].attn.wq.out_features == 64
    assert TransformerConfig().resolved_head_dim == 32
    with pytest.raises(ValueError, match="Transformer needs a TransformerConfig, got dict"):
        Transformer({"d_model": 32})


TINY = TransformerConfig(vocab_size=70, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, attention="dense")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        pytest.param({"lr": NAN}, r"SparseLMModule\.lr must be a finite number >= 0, got nan", id="lr-nan"),
        pytest.param({"lr": -1e-3}, r"SparseLMModule\.lr must be a finite number >= 0, got -0\.001", id="lr-negative"),
        pytest.param(
            {"selector_lr": INF},
            r"SparseLMModule\.selector_lr must be a finite number >= 0 or None, got inf",
            id="selector-lr-inf",
        ),
        pytest.param(
            {"weight_decay": NAN},
            r"SparseLMModule\.weight_decay must be a finite number >= 0, got nan",
            id="weight-decay-nan",
        ),
        pytest.param(
            {"betas": (0.9, 1.0)},
            r"SparseLMModule\.betas\[1\] must be a finite number in \[0, 1\), got 1\.0",
            id="beta2-one",
        ),
        pytest.param({"betas": (0.9,)}, r"SparseLMModule\.betas must be a pair", id="betas-single"),
        pytest.param(
            {"warmup_steps": 1.5},
            r"SparseLMModule\.warmup_steps must be an int >= 0, got 1\.5 \(float\)",
            id="warmup-float",
        ),
        pytest.param(
            {"warmup_steps": -1}, r"SparseLMModule\.warmup_steps must be an int >= 0, got -1", id="warmup-negative"
        ),
        pytest.param(
            {"min_lr_ratio": 1.5},
            r"SparseLMModule\.min_lr_ratio must be a finite number in \[0, 1\], got 1\.5",
            id="min-lr-ratio-above-one",
        ),
        pytest.param(
            {"selector_loss_weight": INF},
            r"SparseLMModule\.selector_loss_weight must be a finite number >= 0, got inf",
            id="selector-loss-weight-inf",
        ),
        pytest.param(
            {"train_only_selector": "false"},
            r"SparseLMModule\.train_only_selector must be a bool, got 'false' \(str\)",
            id="train-only-selector-str-is-truthy",
        ),
        pytest.param(
            {"init_from": 3}, r"SparseLMModule\.init_from must be a checkpoint path or None, got 3", id="init-from-int"
        ),
        pytest.param(
            {"model": {"d_modell": 64}},
            r"SparseLMModule\.model has no key 'd_modell' \(did you mean 'd_model'\?\)",
            id="model-dict-unknown-key",
        ),
        pytest.param({"model": 3}, r"SparseLMModule\.model must be a TransformerConfig or a dict", id="model-int"),
    ],
)
def test_lm_module_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseLMModule(**{"model": TINY, **kwargs})


def test_selector_lr_zero_is_zero_not_lr():
    """``selector_lr=0`` used to fall back to ``lr`` (``selector_lr or lr``), training the selectors it
    was meant to freeze."""
    from lightning.pytorch import Trainer

    cfg = TransformerConfig(
        vocab_size=70,
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        sparse=dict(block_q=16, block_k=16, backend="reference"),
    )
    module = SparseLMModule(cfg, lr=1e-3, selector_lr=0.0)
    module.trainer = Trainer(
        max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    groups = module.configure_optimizers()["optimizer"].param_groups
    assert sorted(g["initial_lr"] for g in groups) == [0.0, 1e-3, 1e-3]  # before the warm-up factor


@pytest.mark.parametrize(
    "kwargs,message",
    [
        pytest.param(
            {"sparse": {"top_kk": 8}},
            r"HFCausalLMModule\.sparse has no key 'top_kk' \(did you mean 'top_k'\?\)",
            id="sparse-unknown-key",
        ),
        pytest.param(
            {"sparse": {"scale": NAN}},
            r"SparseAttentionConfig\.scale must be a finite number > 0 or None",
            id="sparse-scale-nan",
        ),
        pytest.param({"sparse": 3}, r"HFCausalLMModule\.sparse must be a dict", id="sparse-int"),
        pytest.param({"dtype": "float33"}, r"HFCausalLMModule\.dtype must be one of \('float32'", id="dtype-unknown"),
        pytest.param({"attention": "flash"}, r"HFCausalLMModule\.attention must be one of", id="attention-unknown"),
        pytest.param({"lr": NAN}, r"HFCausalLMModule\.lr must be a finite number >= 0, got nan", id="lr-nan"),
        pytest.param(
            {"gradient_checkpointing": 1},
            r"HFCausalLMModule\.gradient_checkpointing must be a bool",
            id="gradient-checkpointing-int",
        ),
        pytest.param(
            {"checkpoint_keeps_attention": "yes"},
            r"HFCausalLMModule\.checkpoint_keeps_attention must be a bool",
            id="keeps-attention-str",
        ),
        pytest.param(
            {"pretrained_path": None},
            r"HFCausalLMModule\.pretrained_path must be a local checkpoint "
            r"directory \(config\.json \+ weights\), got None",
            id="pretrained-path-none",
        ),
        pytest.param(
            {"pretrained_path": "/no/such/dir"},
            r"HFCausalLMModule\.pretrained_path must be a local "
            r"checkpoint directory .*got '/no/such/dir'",
            id="pretrained-path-missing-was-hub-repo-id-error",
        ),
    ],
)
def test_hf_module_rejects_bad_arguments_before_loading(kwargs, message, tmp_path):
    # An empty directory: every check must fire before transformers tries to load from it.
    with pytest.raises(ValueError, match=message):
        HFCausalLMModule(**{"pretrained_path": str(tmp_path), **kwargs})


def test_hf_enable_rejects_a_dict_config():
    from sparse_train.integrations import hf

    with pytest.raises(ValueError, match="hf.enable: config must be a SparseAttentionConfig or None, got dict"):
        hf.enable(torch.nn.Linear(2, 2), {"top_k": 4})


DATA = dict(seq_len=128, num_pairs=2, num_queries=2, num_keys=4, batch_size=2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        pytest.param(
            {"batch_size": 0},
            r"RetrievalDataModule\.batch_size must be a positive int, got 0",
            id="batch-size-zero-was-IndexError",
        ),
        pytest.param(
            {"batch_size": 1.5},
            r"RetrievalDataModule\.batch_size must be a positive int, got 1\.5 \(float\)",
            id="batch-size-float",
        ),
        pytest.param(
            {"seq_len": 128.5}, r"RetrievalDataModule\.seq_len must be a positive int, got 128\.5", id="seq-len-float"
        ),
        pytest.param(
            {"num_values": 0}, r"RetrievalDataModule\.num_values must be a positive int, got 0", id="num-values-zero"
        ),
        pytest.param(
            {"num_queries": 0},
            r"RetrievalDataModule\.num_queries must be a positive int, got 0",
            id="num-queries-zero-scores-nothing",
        ),
        pytest.param(
            {"needle_len": 1.5},
            r"RetrievalDataModule\.needle_len must be a positive int, got 1\.5",
            id="needle-len-float",
        ),
        pytest.param(
            {"filler": "noise"},
            r"RetrievalDataModule\.filler must be one of \('repeat', 'random'\)",
            id="filler-unknown",
        ),
        pytest.param(
            {"eval_batch_size": 0},
            r"RetrievalDataModule\.eval_batch_size must be a positive int or None",
            id="eval-batch-size-zero",
        ),
        pytest.param(
            {"train_steps": 0}, r"RetrievalDataModule\.train_steps must be a positive int, got 0", id="train-steps-zero"
        ),
        pytest.param(
            {"val_samples": -1},
            r"RetrievalDataModule\.val_samples must be an int >= 0, got -1",
            id="val-samples-negative",
        ),
        pytest.param({"train_seed": 0.5}, r"RetrievalDataModule\.train_seed must be an int, got 0\.5", id="seed-float"),
        pytest.param(
            {"curriculum": [{"steps": 1.5, "seq_len": 64, "batch_size": 2}]},
            r"CurriculumStage\.steps must be an int >= 0, got 1\.5 \(float\)",
            id="stage-steps-float",
        ),
        pytest.param(
            {"curriculum": [{"steps": 1, "seq_len": 64, "batch_size": 0}]},
            r"CurriculumStage\.batch_size must be a positive int, got 0",
            id="stage-batch-size-zero",
        ),
        pytest.param(
            {"curriculum": [{"steps": -1, "seq_len": 64, "batch_size": 2}]},
            r"CurriculumStage\.steps must be an int >= 0, got -1",
            id="stage-steps-negative",
        ),
        pytest.param(
            {"curriculum": [{"steps": 1, "seq_len": 64}]},
            r"RetrievalDataModule\.curriculum\[0\] lacks batch_size",
            id="stage-missing-key",
        ),
        pytest.param(
            {"curriculum": [{"steps": 1, "seq_len": 64, "batch_size": 2, "seqlen": 3}]},
            r"RetrievalDataModule\.curriculum\[0\] has no key 'seqlen' \(did you mean 'seq_len'\?\)",
            id="stage-unknown-key",
        ),
    ],
)
def test_retrieval_data_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetrievalDataModule(**{**DATA, **kwargs})


def test_retrieval_task_and_stage_check_their_own_arguments():
    with pytest.raises(ValueError, match=r"RetrievalTask\.num_keys must be a positive int, got 0"):
        RetrievalTask(seq_len=128, num_pairs=2, num_queries=2, num_keys=0)
    with pytest.raises(ValueError, match=r"CurriculumStage\.seq_len must be a positive int, got 0"):
        CurriculumStage(steps=1, seq_len=0, batch_size=1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        pytest.param(
            {"paths": "corpus"},
            r"ByteLMDataModule\.paths must be a list .* write \['corpus'\]",
            id="paths-single-string-read-per-character",
        ),
        pytest.param(
            {"paths": [3]},
            r"ByteLMDataModule\.paths must be a list of files or directories or None",
            id="paths-int-entry",
        ),
        pytest.param(
            {"paths": ["/no/such/corpus"]},
            r"ByteLMDataModule\.paths: '/no/such/corpus' does not exist",
            id="paths-missing-was-raised-mid-fit",
        ),
        pytest.param({"seq_len": 0}, r"ByteLMDataModule\.seq_len must be a positive int, got 0", id="seq-len-zero"),
        pytest.param(
            {"batch_size": 0}, r"ByteLMDataModule\.batch_size must be a positive int, got 0", id="batch-size-zero"
        ),
        pytest.param(
            {"val_fraction": NAN},
            r"ByteLMDataModule\.val_fraction must be a finite number in \[0, 1\), got nan",
            id="val-fraction-nan",
        ),
        pytest.param(
            {"val_fraction": 1.0},
            r"ByteLMDataModule\.val_fraction must be a finite number in \[0, 1\), got 1\.0",
            id="val-fraction-one-leaves-no-training-data",
        ),
        pytest.param(
            {"max_bytes": 0}, r"ByteLMDataModule\.max_bytes must be a positive int, got 0", id="max-bytes-zero"
        ),
        pytest.param(
            {"num_workers": -1}, r"ByteLMDataModule\.num_workers must be an int >= 0, got -1", id="num-workers-negative"
        ),
    ],
)
def test_byte_lm_data_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ByteLMDataModule(**kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        pytest.param({"every_n_steps": 0}, r"StepTimer\.every_n_steps must be a positive int, got 0", id="every-zero"),
        pytest.param(
            {"every_n_steps": 2.5}, r"StepTimer\.every_n_steps must be a positive int, got 2\.5", id="every-float"
        ),
        pytest.param({"prog_bar": "no"}, r"StepTimer\.prog_bar must be a bool", id="prog-bar-str"),
    ],
)
def test_step_timer_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepTimer(**kwargs)


@pytest.mark.parametrize(
    "check,value,message",
    [
        pytest.param(
            lambda v: check_int("x.n", v, minimum=0, maximum=4),
            5,
            "x.n must be an int >= 0 and <= 4, got 5",
            id="int-above-maximum",
        ),
        pytest.param(lambda v: check_int("x.n", v), None, "x.n must be an int, got None (NoneType)", id="int-none"),
        pytest.param(
            lambda v: check_float("x.f", v, minimum=0.0, finite=False),
            -INF,
            "x.f must be a number >= 0, got -inf",
            id="float-not-finite-still-bounded",
        ),
        pytest.param(
            lambda v: check_float("x.f", v, minimum=0.0, finite=False),
            NAN,
            "x.f must be a number >= 0, got nan",
            id="float-nan-never-passes",
        ),
    ],
)
def test_check_helpers_messages(check, value, message):
    with pytest.raises(ValueError) as exc_info:
        check(value)
    assert str(exc_info.value) == message


def test_valid_values_pass_unchanged():
    cfg = st.SparseAttentionConfig(scale=1, dropout_p=0, distill_weight=0, kernel_options=None, distill_query_rows=64)
    assert cfg.scale == 1 and cfg.kernel_options == st.KernelOptions()
    check_float("x.f", INF, minimum=0.0, finite=False)
    check_int("x.n", 4, minimum=0, maximum=4)
