"""The ``sparse-train`` console script: LightningCLI with built-in recipes and offline-only logging.

    sparse-train fit --config retrieval                 # built-in recipe by name
    sparse-train fit --config recipes/retrieval.yaml    # or any YAML path
    sparse-train fit --config retrieval --trainer.max_steps=100 --model.init_args.lr=1e-3
    sparse-train validate --config retrieval --ckpt_path runs/retrieval/.../last.ckpt
    sparse-train recipes                                # list built-in recipes

Bare recipe names resolve to ``<repo>/recipes`` when the package runs from a source checkout
(editable install or ``PYTHONPATH``), otherwise through ``importlib.resources`` on the package
``sparse_train.recipes`` (the top-level ``recipes/`` directory, shipped in the wheel).

Logging never touches the network: ``WANDB_MODE`` is forced to ``offline`` before wandb can be
imported. Unless a recipe or flag names a logger, the run logs to CSV (always; the plot script reads
it) and, when wandb is installed, also to an offline W&B run (``wandb sync`` uploads it later).
``--logger_backend`` (or ``$SPARSE_TRAIN_LOGGER``) picks ``auto`` | ``csv`` | ``wandb`` | ``none``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

__all__ = ["main", "run_cli", "resolve_recipe", "list_recipes"]

_LOGGER_CHOICES = ("auto", "csv", "wandb", "none")


def _recipe_dirs() -> list[Path]:
    # A source checkout uses its own recipes only: with another checkout installed in editable mode,
    # importlib.resources resolves sparse_train.recipes to *that* checkout's recipes/, whose fields may
    # not exist in the code being run.
    repo = Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").is_file() and (repo / "recipes").is_dir():
        return [repo / "recipes"]
    dirs: list[Path] = []
    with contextlib.suppress(ModuleNotFoundError, TypeError):
        root = resources.files("sparse_train.recipes")
        if isinstance(root, Path) or hasattr(root, "iterdir"):
            dirs.append(Path(str(root)))
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def list_recipes() -> dict[str, Path]:
    """Built-in recipe names mapped to their files (first directory wins)."""
    found: dict[str, Path] = {}
    for d in _recipe_dirs():
        for p in sorted(d.glob("*.yaml")):
            found.setdefault(p.stem, p)
    return found


def resolve_recipe(name: str) -> str:
    """A ``--config`` value as a file path: an existing file as given, otherwise a built-in recipe name
    (with or without ``.yaml``). Raises ``SystemExit`` listing the recipes when nothing matches."""
    if Path(name).is_file():
        return name
    recipes = list_recipes()
    stem = Path(name).name
    stem = stem[: -len(".yaml")] if stem.endswith(".yaml") else stem
    if stem in recipes and (Path(name).parent == Path(".") or not Path(name).exists()):
        return str(recipes[stem])
    raise SystemExit(f"sparse-train: no config file {name!r} and no built-in recipe {stem!r}; "
                     f"built-in recipes: {', '.join(recipes) or '(none found)'}")


def _rewrite_config_args(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            value = next(it, None)
            out.append(arg)
            if value is not None:
                out.append(resolve_recipe(value))
        elif arg.startswith("--config="):
            out.append("--config=" + resolve_recipe(arg.split("=", 1)[1]))
        else:
            out.append(arg)
    return out


def _recipe_name(argv: Sequence[str]) -> str:
    name = "run"
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            name = Path(argv[i + 1]).stem
        elif arg.startswith("--config="):
            name = Path(arg.split("=", 1)[1]).stem
    return name


def _print_recipes() -> None:
    for name, path in list_recipes().items():
        purpose = ""
        for line in path.read_text().splitlines():
            text = line.lstrip("# ").strip()
            if line.startswith("#") and text and not text.lower().startswith(("sparse-train", "recipe")):
                purpose = text
                break
        print(f"{name:28s} {purpose}")


def _make_default_loggers(backend: str, save_dir: str, name: str) -> Any:
    from lightning.pytorch.loggers import CSVLogger

    if backend == "none":
        return False
    loggers: list[Any] = [CSVLogger(save_dir=save_dir, name="logs")]
    want_wandb = backend == "wandb" or (backend == "auto" and importlib.util.find_spec("wandb") is not None)
    if want_wandb:
        from lightning.pytorch.loggers import WandbLogger

        # CSV stays first: checkpoints default to the first logger's directory, next to metrics.csv.
        loggers.append(WandbLogger(save_dir=save_dir, project="sparse-train", name=name, offline=True))
    return loggers


def _cli_class() -> type:
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    class SparseTrainCLI(LightningCLI):
        """LightningCLI whose default logger is offline W&B + CSV (see module docstring)."""

        recipe_name = "run"

        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.add_argument("--logger_backend", type=str, default=os.environ.get("SPARSE_TRAIN_LOGGER", "auto"),
                                help=f"default logger when trainer.logger is unset: one of {_LOGGER_CHOICES}")

        def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
            logger = config.get("logger")
            if logger is None or logger is True:
                sub = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
                backend = sub.get("logger_backend", "auto")
                if backend not in _LOGGER_CHOICES:
                    raise SystemExit(f"--logger_backend must be one of {_LOGGER_CHOICES}, got {backend!r}")
                if not config.get("fast_dev_run"):
                    save_dir = config.get("default_root_dir") or os.path.join("runs", self.recipe_name)
                    config["logger"] = _make_default_loggers(backend, save_dir, self.recipe_name)
            return super()._instantiate_trainer(config, callbacks)

    return SparseTrainCLI


@contextlib.contextmanager
def _offline_env() -> Iterator[None]:
    # Set before any wandb import: an offline run never opens a socket to the W&B servers.
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_DISABLE_GIT", "true")
    yield


def main(args: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``sparse-train`` console script; ``args`` defaults to ``sys.argv[1:]``.
    Returns None (a console script's return value becomes its exit status)."""
    run_cli(args)


def run_cli(args: Optional[Sequence[str]] = None, run: bool = True) -> Any:
    """Run the CLI and return the ``LightningCLI`` object (its ``trainer``, ``model``, ``datamodule``);
    for tests and notebooks."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] in (["recipes"], ["--list-recipes"]):
        _print_recipes()
        return None
    argv = _rewrite_config_args(argv)
    with _offline_env():
        from lightning.pytorch import LightningDataModule, LightningModule

        cls = _cli_class()
        cls.recipe_name = _recipe_name(argv)
        return cls(
            model_class=LightningModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=argv,
            run=run,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": "sparse-train: learned block-sparse attention training"},
        )


if __name__ == "__main__":
    main()
