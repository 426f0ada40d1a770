"""Every built-in recipe parses and runs one training + validation batch through the ``sparse-train``
CLI on CPU, shrunk by recipe-agnostic overrides (tiny model, short context, fast_dev_run)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from sparse_train import cli

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _tiny_overrides(recipe: str) -> list[str]:
    conf = yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())
    data_cls = conf["data"]["class_path"]
    args = [
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true",
        "--trainer.fast_dev_run=1", "--data.init_args.seq_len=256", "--data.init_args.batch_size=2",
        "--model.init_args.model.d_model=64", "--model.init_args.model.n_layers=1",
    ]
    if data_cls.endswith("RetrievalDataModule"):
        args += ["--data.init_args.curriculum=[]", "--data.init_args.eval_batch_size=2",
                 "--data.init_args.num_workers=0"]
    else:
        args += ["--data.init_args.max_bytes=200000"]
    if conf["model"]["init_args"].get("init_from"):
        args += ["--model.init_args.init_from=null"]  # the previous stage's checkpoint does not exist here
    return args


def test_every_recipe_is_tested_and_documented():
    expected = {"retrieval", "retrieval_dense", "retrieval_16k", "retrieval_16k_dense", "finetune_stage1_dense",
                "finetune_stage2_selector", "finetune_stage3_sparse", "lm_bytes", "lm_bytes_dense"}
    assert expected <= set(RECIPES)
    readme = (RECIPES_DIR / "README.md").read_text()
    for name in RECIPES:
        text = (RECIPES_DIR / f"{name}.yaml").read_text()
        assert text.startswith("#"), f"{name}.yaml lacks a header comment"
        assert f"sparse-train fit --config {name}" in text, f"{name}.yaml header lacks its exact command"
        assert "Override" in text or "override" in text, f"{name}.yaml header lacks an override example"
        assert name in readme, f"recipes/README.md does not list {name}"


def test_dense_twins_differ_only_in_attention():
    for sparse, dense in [("retrieval", "retrieval_dense"), ("retrieval_16k", "retrieval_16k_dense"),
                          ("lm_bytes", "lm_bytes_dense")]:
        a = yaml.safe_load((RECIPES_DIR / f"{sparse}.yaml").read_text())
        b = yaml.safe_load((RECIPES_DIR / f"{dense}.yaml").read_text())
        assert a["model"]["init_args"]["model"].pop("attention") == "sparse"
        assert b["model"]["init_args"]["model"].pop("attention") == "dense"
        a["model"]["init_args"]["model"].pop("sparse")
        a["trainer"].pop("default_root_dir"), b["trainer"].pop("default_root_dir")
        assert a == b, f"{dense} is not a twin of {sparse}"


def test_resolve_recipe_by_name_and_path():
    assert Path(cli.resolve_recipe("retrieval")).name == "retrieval.yaml"
    assert Path(cli.resolve_recipe("retrieval.yaml")).name == "retrieval.yaml"
    path = str(RECIPES_DIR / "lm_bytes.yaml")
    assert cli.resolve_recipe(path) == path
    with pytest.raises(SystemExit, match="no built-in recipe"):
        cli.resolve_recipe("does_not_exist")
    assert set(RECIPES) <= set(cli.list_recipes())


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_fast_dev_run(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # recipes write runs/... relative to the working directory
    result = cli.run_cli(["fit", "--config", recipe, *_tiny_overrides(recipe)])
    trainer = result.trainer
    assert trainer.state.finished, f"{recipe}: fit did not finish"
    assert trainer.global_step == 1
    metrics = trainer.callback_metrics
    assert "val/acc" in metrics and "train/loss" in metrics
    assert math.isfinite(float(metrics["train/loss"]))
