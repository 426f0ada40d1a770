"""Every built-in recipe parses and runs one training + validation batch through the ``sparse-train``
CLI on CPU, shrunk by recipe-agnostic overrides (tiny model, short context, fast_dev_run)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from builders import save_tiny_tokenizer, write_tiny_corpus

from sparse_train import cli

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _is_hf(conf: dict) -> bool:
    return conf["model"]["class_path"].endswith("HFCausalLMModule")


def _tiny_overrides(recipe: str, hf_checkpoint: Path | None = None, text_corpus: Path | None = None) -> list[str]:
    conf = yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())
    data_cls = conf["data"]["class_path"]
    args = [
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.precision=32-true",
        "--trainer.fast_dev_run=1",
        "--data.init_args.seq_len=256",
        "--data.init_args.batch_size=2",
    ]
    if _is_hf(conf):  # architecture fixed by the checkpoint; 16-token blocks keep 256 tokens sparse
        args += [
            f"--model.init_args.pretrained_path={hf_checkpoint}",
            "--model.init_args.sparse.block_q=16",
            "--model.init_args.sparse.block_k=16",
            "--model.init_args.sparse.top_k=4",
            "--model.init_args.sparse.window=1",
        ]
    else:
        args += ["--model.init_args.model.d_model=64", "--model.init_args.model.n_layers=1"]
    if data_cls.endswith("RetrievalDataModule"):
        args += [
            "--data.init_args.curriculum=[]",
            "--data.init_args.eval_batch_size=2",
            "--data.init_args.num_workers=0",
        ]
    elif data_cls.endswith("TextDataModule"):  # tokenizer: the checkpoint's own (saved beside its weights)
        args += [f"--data.init_args.paths=[{text_corpus}]", "--data.init_args.val_fraction=0.2"]
    else:
        args += ["--data.init_args.max_bytes=200000"]
    if conf["model"]["init_args"].get("init_from"):
        args += ["--model.init_args.init_from=null"]  # the previous stage's checkpoint does not exist here
    return args


def test_every_recipe_is_tested_and_documented():
    expected = {
        "retrieval",
        "retrieval_dense",
        "retrieval_16k",
        "retrieval_16k_dense",
        "finetune_stage1_dense",
        "finetune_stage2_selector",
        "finetune_stage3_sparse",
        "lm_bytes",
        "lm_bytes_dense",
        "finetune_hf_stage2_selector",
        "finetune_hf_stage3_sparse",
    }
    assert expected <= set(RECIPES)
    readme = (RECIPES_DIR / "README.md").read_text()
    for name in RECIPES:
        text = (RECIPES_DIR / f"{name}.yaml").read_text()
        assert text.startswith("#"), f"{name}.yaml lacks a header comment"
        assert f"sparse-train fit --config {name}" in text, f"{name}.yaml header lacks its exact command"
        assert "Override" in text or "override" in text, f"{name}.yaml header lacks an override example"
        assert name in readme, f"recipes/README.md does not list {name}"


def test_dense_twins_differ_only_in_attention():
    for sparse, dense in [
        ("retrieval", "retrieval_dense"),
        ("retrieval_16k", "retrieval_16k_dense"),
        ("lm_bytes", "lm_bytes_dense"),
    ]:
        a = yaml.safe_load((RECIPES_DIR / f"{sparse}.yaml").read_text())
        b = yaml.safe_load((RECIPES_DIR / f"{dense}.yaml").read_text())
        assert a["model"]["init_args"]["model"].pop("attention") == "sparse"
        assert b["model"]["init_args"]["model"].pop("attention") == "dense"
        a["model"]["init_args"]["model"].pop("sparse")
        # the sparse side may quote its twin's committed accuracy for the final line (reporting only)
        a["model"]["init_args"].pop("dense_twin_acc", None)
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


def test_source_checkout_resolves_its_own_recipes():
    """With another checkout installed in editable mode, importlib.resources pointed ``--config retrieval``
    at *that* checkout's recipes, so this checkout's code ran (and was tested) with foreign recipes."""
    assert Path(cli.resolve_recipe("retrieval")) == RECIPES_DIR / "retrieval.yaml"
    assert set(cli.list_recipes().values()) == set(RECIPES_DIR.glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny_hf_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint directory (config.json + safetensors + a word-level tokenizer), built offline."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return save_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def tiny_text_corpus(tmp_path_factory) -> Path:
    """Text and JSONL documents of the tiny tokenizer's words (~2.5K tokens, one document longer than 256)."""
    return write_tiny_corpus(
        tmp_path_factory.mktemp("text") / "corpus",
        lengths_txt=(300, 40, 7, 110, 1, 25, 90, 150, 64, 200),
        lengths_jsonl=(5, 2, 160, 9, 14, 4, 180, 6, 75, 120, 33, 250),
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_fast_dev_run(recipe, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)  # recipes write runs/... relative to the working directory
    conf = yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())
    hf_checkpoint = request.getfixturevalue("tiny_hf_checkpoint") if _is_hf(conf) else None
    text_corpus = request.getfixturevalue("tiny_text_corpus") if _is_hf(conf) else None
    result = cli.run_cli(["fit", "--config", recipe, *_tiny_overrides(recipe, hf_checkpoint, text_corpus)])
    trainer = result.trainer
    assert trainer.state.finished, f"{recipe}: fit did not finish"
    assert trainer.global_step == 1
    metrics = trainer.callback_metrics
    assert "val/acc" in metrics and "train/loss" in metrics
    assert math.isfinite(float(metrics["train/loss"]))


def test_hf_checkpoint_dense_to_sparse_stages(tiny_hf_checkpoint, tiny_text_corpus, tmp_path, monkeypatch):
    """A local Hugging Face checkpoint as the stage-1 dense model: stage 2 (selectors only) then stage 3
    (loads stage 2, everything trains), both through the CLI with the built-in recipes."""
    from transformers import AutoModelForCausalLM

    from sparse_train.lightning import HFCausalLMModule

    monkeypatch.chdir(tmp_path)
    at_fit_start: dict[str, dict[str, torch.Tensor]] = {}
    original = HFCausalLMModule.on_fit_start

    def snapshot(self):
        at_fit_start[self.hparams.init_from or "stage2"] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        original(self)

    monkeypatch.setattr(HFCausalLMModule, "on_fit_start", snapshot)
    common = [
        "--trainer.accelerator=cpu",
        "--trainer.precision=32-true",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--trainer.val_check_interval=2",
        "--logger_backend=csv",
        f"--model.init_args.pretrained_path={tiny_hf_checkpoint}",
        "--data.init_args.seq_len=128",
        "--data.init_args.batch_size=2",
        "--data.init_args.eval_batch_size=2",
        f"--data.init_args.paths=[{tiny_text_corpus}]",
        "--data.init_args.val_fraction=0.2",
        # 8 blocks of 16 tokens, at most 4 selected: the sparse path runs, not the dense shortcut
        "--model.init_args.sparse.block_q=16",
        "--model.init_args.sparse.block_k=16",
        "--model.init_args.sparse.top_k=2",
        "--model.init_args.sparse.window=1",
    ]

    # ---- stage 2: base frozen, only the selectors learn
    stage2 = cli.run_cli(["fit", "--config", "finetune_hf_stage2_selector", *common])
    assert stage2.trainer.global_step == 2
    module2 = stage2.model
    selectors = {k for k in module2.state_dict() if ".sparse_attention." in k}
    assert selectors, "no selector was attached"
    assert module2.trainer.callback_metrics["attn/dense_path"] == 0  # the sparse path ran
    trainable = {f"model.{n}" for n, p in module2.model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in module2.model.named_parameters(prefix="model") if n in selectors}
    final2 = {k: v.detach().clone() for k, v in module2.state_dict().items()}
    initial2 = at_fit_start["stage2"]
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, local_files_only=True).state_dict()
    base = {k: v for k, v in final2.items() if k not in selectors}
    assert {k.removeprefix("model.lm.") for k in base} == set(reference)
    for k, v in base.items():
        assert torch.equal(v, reference[k.removeprefix("model.lm.")]), f"stage 2 changed base weight {k}"
    changed = [k for k in selectors if not torch.equal(final2[k], initial2[k])]
    assert changed, "stage 2 did not update any selector weight"
    assert math.isfinite(float(stage2.trainer.callback_metrics["train/selector_loss"]))

    # hyperparameters are recorded outside the CLI too (load_from_checkpoint rebuilds from them)
    assert HFCausalLMModule(str(tiny_hf_checkpoint), attention="dense").hparams.pretrained_path == str(
        tiny_hf_checkpoint
    )

    # ---- stage 3: starts from stage 2's checkpoint (selectors included), the whole model trains
    ckpt = "runs/finetune_hf/stage2/last.ckpt"
    assert Path(ckpt).is_file()
    stage3 = cli.run_cli(["fit", "--config", "finetune_hf_stage3_sparse", *common])
    assert stage3.trainer.global_step == 2
    initial3 = at_fit_start[ckpt]
    assert initial3.keys() == final2.keys()
    for k, v in final2.items():
        assert torch.equal(initial3[k], v), f"stage 3 did not start from stage 2's {k}"
    final3 = stage3.model.state_dict()
    assert any(not torch.equal(final3[k], initial3[k]) for k in base), "stage 3 did not train the base model"
    metrics = stage3.trainer.callback_metrics
    for key in ("train/loss", "train/lm_loss", "train/selector_loss", "val/loss"):
        assert math.isfinite(float(metrics[key])), key

    # ---- export: the stage-3 checkpoint becomes a Hugging Face directory that loads with its selectors
    from sparse_train.integrations import hf

    out = cli.run_cli(["export", "--ckpt", "runs/finetune_hf/stage3/last.ckpt", "--out", "exported"])
    restored = hf.from_pretrained(AutoModelForCausalLM, out, local_files_only=True)
    trained = stage3.model.model.lm
    trained.eval()
    restored.eval()
    ids = torch.randint(0, 96, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, trained(ids).logits, rtol=0, atol=0)
    with pytest.raises(SystemExit):
        cli.run_cli(["export", "--ckpt", "missing.ckpt", "--out", "x"])
