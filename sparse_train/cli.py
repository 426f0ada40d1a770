"""The ``sparse-train`` console script: LightningCLI with built-in recipes and offline-only logging.

    sparse-train fit --config retrieval                 # built-in recipe by name
    sparse-train fit --config recipes/retrieval.yaml    # or any YAML path
    sparse-train fit --config retrieval --trainer.max_steps=100 --model.init_args.lr=1e-3
    sparse-train validate --config retrieval --ckpt_path runs/retrieval/.../last.ckpt
    sparse-train recipes                                # list built-in recipes

Bare recipe names resolve to ``<repo>/recipes`` when the package runs from a source checkout
(editable install or ``PYTHONPATH``), otherwise through ``importlib.resources`` on the package
``sparse_train.recipes`` (the top-level ``recipes/`` directory, shipped in the wheel).

Argument and config errors print one line naming the key (``SPARSE_TRAIN_DEBUG=1`` shows the
traceback); errors raised while training keep their traceback. Step-based runs label the progress bar
``step s/max_steps``.

Logging never touches the network: ``WANDB_MODE`` is forced to ``offline`` before wandb can be
imported. Unless a recipe or flag names a logger, the run logs to CSV (always; the plot script reads
it) and, when wandb is installed, also to an offline W&B run (``wandb sync`` uploads it later), both
under the trainer's ``default_root_dir`` (the recipe's, or ``runs/<recipe>`` when unset).
``--logger_backend`` (or ``$SPARSE_TRAIN_LOGGER``) picks ``auto`` | ``csv`` | ``wandb`` | ``none``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

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
    raise SystemExit(
        f"sparse-train: no config file {name!r} and no built-in recipe {stem!r}; "
        f"built-in recipes: {', '.join(recipes) or '(none found)'}"
    )


def _recipe_name(argv: Sequence[str]) -> str:
    name = "run"
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            name = Path(argv[i + 1]).stem
        elif arg.startswith("--config="):
            name = Path(arg.split("=", 1)[1]).stem
    return name


# ---------------------------------------------------------------------------------------- error messages
# Argument and config errors print one line naming the key (and what it accepts) plus a hint line, instead
# of jsonargparse's 50-line usage or two chained tracebacks. Errors raised while training keep their
# traceback. SPARSE_TRAIN_DEBUG=1 restores the full traceback for the short ones too.
DEBUG_ENV = "SPARSE_TRAIN_DEBUG"


def _config_errors() -> tuple[type[BaseException], ...]:
    """Exception types that, raised while the CLI builds model, data and trainer, mean "this configuration
    is wrong". Anything else there (AttributeError, NameError, ...) is a bug and keeps its traceback."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return ValueError, TypeError, KeyError, OSError, RuntimeError, MisconfigurationException


# jsonargparse re-raises a nested failure inside these wrappers (chained through __cause__).
_WRAPPER_PREFIXES = (
    'Parser key "',
    "Does not validate against any of the Union subtypes",
    "Problem with given class_path",
)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _chain(ex: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while ex is not None and all(ex is not e for e in seen):
        seen.append(ex)
        ex = ex.__cause__ or ex.__context__
    return seen


def _allowed_keys(class_path: str, rel_key: str) -> list[str]:
    """Argument names accepted at ``rel_key``'s level under ``class_path`` (its init parameters, or the
    fields of a dataclass parameter for a dotted key such as ``model.d_modell``); [] if unknown."""
    import dataclasses
    import importlib
    import inspect
    import typing

    try:
        module, _, name = class_path.rpartition(".")
        target: Any = getattr(importlib.import_module(module), name)
        for part in rel_key.split(".")[:-1]:
            hints = typing.get_type_hints(target if dataclasses.is_dataclass(target) else target.__init__)
            target = hints[part]
            if typing.get_origin(target) is typing.Union:  # Optional[X] -> X
                target = next(a for a in typing.get_args(target) if a is not type(None))
        if dataclasses.is_dataclass(target):
            return [f.name for f in dataclasses.fields(target)]
        if not inspect.isclass(target):
            return []
        return [n for n in inspect.signature(target.__init__).parameters if n not in ("self", "args", "kwargs")]
    except Exception:  # a hint only: never let it replace the error being reported
        return []


def _suggest(word: str, candidates: Sequence[str]) -> str | None:
    import difflib

    close = difflib.get_close_matches(word, list(candidates), n=1)
    return close[0] if close else None


def _tidy(detail: str) -> str:
    detail = re.sub(r"<class '([\w.]+)'>", r"\1", detail)
    detail = re.sub(r"typing\.Literal\[(.*)\]", r"one of \1", detail)
    return re.sub(r"^Expected a (.*)\. Got value: (.*)$", r"expected \1, got \2", detail)


def _describe_error(ex: BaseException | None, message: str, options: Sequence[str] = ()) -> str:
    """One line from a jsonargparse error chain: the full dotted key and the innermost real message.

    ``options`` are the failing parser's option strings, used to suggest a close one for a misspelt
    top-level option (``--trainer.max_stepz``)."""
    keys: list[str] = []
    class_path: str | None = None
    under_class = False
    root: str | None = None
    for e in _chain(ex) or [None]:
        text = str(e) if e is not None else message
        match = re.match(r'Parser key "([^"]+)":', text)
        if match:
            if not keys or keys[-1] != match.group(1):
                if under_class:
                    keys.append("init_args")
                    under_class = False
                keys.append(match.group(1))
            continue
        match = re.match(r"Problem with given class_path '([^']+)'", text)
        if match:
            class_path, under_class = match.group(1), True
            continue
        if not text.startswith(_WRAPPER_PREFIXES):
            root = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            break
    root = root or message.strip().splitlines()[0]
    prefix = ".".join(keys)

    unknown = re.match(r"unrecognized arguments: (.*)$", root) or re.match(r"Option '([^']+)' is not accepted", root)
    if not unknown:
        detail = _tidy(root)
        return f"--{prefix}: {detail}" if prefix else detail
    words = [w for w in unknown.group(1).split() if w.startswith("--")] or unknown.group(1).split()
    rel = words[0].split("=", 1)[0].lstrip("-")
    if class_path is None:
        close = _suggest(rel, [o[2:] for o in options if o.startswith("--")])
        return f"unknown option --{rel}" + (f" (did you mean --{close}?)" if close else "")
    # The key is relative to the class's init arguments (dotted for a nested dataclass argument such as
    # SparseLMModule's model); the allowed keys are those of the level it is on.
    head, _, last = rel.rpartition(".")
    owner = class_path.rsplit(".", 1)[-1] + (f".{head}" if head else "")
    allowed = _allowed_keys(class_path, rel)
    close = _suggest(last, allowed)
    text = (f"--{prefix}: " if prefix else "") + f"unknown key {last!r} in {owner}"
    if close:
        text += f" (did you mean {close!r}?)"
    # Short lists are worth showing in full; the Trainer's 40-odd arguments are not.
    if allowed and len(allowed) <= 30:
        text += f"; allowed keys: {', '.join(allowed)}"
    return text


def _fail(subcommand: str | None, detail: str) -> NoReturn:
    where = f"sparse-train {subcommand}" if subcommand else "sparse-train"
    help_cmd = f"{where} --help"
    raise SystemExit(f"{where}: error: {detail}\n(set {DEBUG_ENV}=1 for the traceback; '{help_cmd}' lists the options)")


def export_hf(args: Sequence[str]) -> Path:
    """``sparse-train export --ckpt last.ckpt --out DIR``: a Lightning checkpoint of an
    ``HFCausalLMModule`` fine-tune -> a Hugging Face model directory (``hf.save_pretrained``: the model's
    own files plus ``sparse_train.safetensors`` / ``sparse_train_config.json``; a dense fine-tune writes
    the model files only). Load it with ``hf.from_pretrained(AutoModelForCausalLM, DIR)``."""
    parser = argparse.ArgumentParser(prog="sparse-train export", description=export_hf.__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint of an HFCausalLMModule run")
    parser.add_argument("--out", required=True, help="output directory (created)")
    options = parser.parse_args(list(args))
    if not Path(options.ckpt).is_file():
        _fail("export", f"--ckpt {options.ckpt!r} is not a file")
    with _offline_env():
        from .integrations import hf
        from .lightning import HFCausalLMModule

        try:
            module = HFCausalLMModule.load_from_checkpoint(options.ckpt, map_location="cpu")
        except (KeyError, TypeError, ValueError) as ex:
            _fail("export", f"{options.ckpt} is not a checkpoint of an HFCausalLMModule run ({ex})")
        lm = module.model.lm
        if module.hparams.attention == "sparse":
            hf.save_pretrained(lm, options.out)
        else:
            lm.save_pretrained(options.out)
    print(f"[sparse-train] exported {options.ckpt} -> {options.out}")
    return Path(options.out)


def _print_recipes() -> None:
    for name, path in list_recipes().items():
        purpose = ""
        for line in path.read_text().splitlines():
            text = line.lstrip("# ").strip()
            if line.startswith("#") and text and not text.lower().startswith(("sparse-train", "recipe")):
                purpose = text
                break
        print(f"{name:28s} {purpose}")


def _make_default_loggers(backend: str, root: str, name: str) -> Any:
    """CSV (``<root>/logs/version_N/metrics.csv``) and, per ``backend``, an offline W&B run
    (``<root>/wandb/offline-run-*``); ``False`` (no logger) for ``"none"``."""
    from lightning.pytorch.loggers import CSVLogger

    if backend == "none":
        return False
    loggers: list[Any] = [CSVLogger(save_dir=root, name="logs")]
    want_wandb = backend == "wandb" or (backend == "auto" and importlib.util.find_spec("wandb") is not None)
    if want_wandb:
        from lightning.pytorch.loggers import WandbLogger

        # CSV stays first: checkpoints default to the first logger's directory, next to metrics.csv.
        loggers.append(WandbLogger(save_dir=root, project="sparse-train", name=name, offline=True))
    return loggers


def _cli_class() -> type:
    import lightning.pytorch as pl
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
    from lightning.pytorch.utilities import rank_zero_warn

    from .lightning.callbacks import step_progress_bar

    class RecipeConfigFile(ActionConfigFile):
        """``--config`` that also takes a built-in recipe name (resolved by :func:`resolve_recipe`)."""

        def __call__(self, parser: Any, cfg: Any, values: Any, option_string: str | None = None) -> None:
            super().__call__(parser, cfg, resolve_recipe(values) if isinstance(values, str) else values, option_string)

    class SparseTrainParser(LightningArgumentParser):
        """Reports a bad argument in one line (see ``_describe_error``) instead of the full usage."""

        def error(self, message: str, ex: Exception | None = None) -> NoReturn:
            # Parsers jsonargparse builds internally (exit_on_error=False) must keep raising: it catches
            # their errors to try the next type of a Union.
            if not self.exit_on_error:
                super().error(message, ex)
            if _debug():
                raise argparse.ArgumentError(None, message) from ex
            subcommand = self.prog.rsplit(" ", 1)[-1] if " [options] " in self.prog else None
            _fail(subcommand, _describe_error(ex, message, list(self._option_string_actions)))

    class SparseTrainCLI(LightningCLI):
        """LightningCLI whose default logger is offline W&B + CSV (see module docstring), whose default
        progress bar counts optimizer steps, and whose argument/config errors are one line."""

        recipe_name = "run"
        argument_parser_class = SparseTrainParser

        def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
            # LightningCLI.init_parser with the recipe-aware --config action.
            kwargs.setdefault("dump_header", [f"lightning.pytorch=={pl.__version__}"])
            parser = self.parser_class(**kwargs)
            parser.add_argument(
                "-c",
                "--config",
                action=RecipeConfigFile,
                help="Built-in recipe name (sparse-train recipes) or path to a YAML config.",
            )
            return parser

        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.add_argument(
                "--logger_backend",
                type=str,
                default=os.environ.get("SPARSE_TRAIN_LOGGER", "auto"),
                help=f"default logger when trainer.logger is unset: one of {_LOGGER_CHOICES}",
            )
            parser.add_argument(
                "--cp",
                type=int,
                default=1,
                help="context parallelism: ranks per sequence (each holds a zig-zag shard); must "
                "divide the world size (devices x nodes; world / cp data-parallel groups), "
                "with --trainer.strategy=ddp; also sets "
                "trainer.use_distributed_sampler=false (docs/context_parallel.md)",
            )

        def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
            # run_cli(args) passes the whole command line by contract (tests, notebooks); Lightning's
            # warning about args next to a non-empty sys.argv (pytest's own flags) does not apply.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
                super().parse_arguments(parser, args)

        def _parse_ckpt_path(self) -> None:
            # Lightning replaces the model's arguments by the hyperparameters stored in --ckpt_path (so
            # the module matches the weights it loads). A setting given for the resumed run would then be
            # dropped without a word; name each one the checkpoint replaced.
            subcommand = self.config.get("subcommand")
            before = _flat_config(self.config[subcommand].get("model")) if subcommand else {}
            super()._parse_ckpt_path()
            if not subcommand:
                return
            after = _flat_config(self.config[subcommand].get("model"))
            replaced = [
                f"{key}: {before[key]!r} -> {after[key]!r}"
                for key in before
                if key in after and before[key] != after[key]
            ]
            if replaced:
                rank_zero_warn(
                    "--ckpt_path: the model arguments stored in the checkpoint replace these values "
                    "of the config/command line: " + "; ".join(replaced) + ". To change a stored "
                    "argument, edit the checkpoint's hyper_parameters (scripts/tools/retrieval_ab.py "
                    "'resume' does) or start a new run with --model.init_args.init_from."
                )

        def _set_seed(self) -> None:
            # Seeding must precede instantiation (the weights are drawn from it), but its "Seed set to"
            # line is held back until instantiation succeeds, so a config error prints only the error.
            with _held_logs("lightning.fabric.utilities.seed") as self._held_seed_logs:
                super()._set_seed()

        def after_instantiate_classes(self) -> None:
            for record in getattr(self, "_held_seed_logs", []):
                logging.getLogger(record.name).handle(record)
            super().after_instantiate_classes()

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except _config_errors() as ex:
                chain = _chain(ex)
                root = next((e for e in chain if not str(e).startswith(_WRAPPER_PREFIXES)), chain[-1])
                if _debug() or not isinstance(root, _config_errors()):
                    raise
                _fail(self.subcommand, _describe_error(ex, str(ex)))

        def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
            # Model and data exist by now: a vocabulary mismatch is a config error, reported before the
            # trainer prints anything rather than from setup() once fit has started.
            check_data = getattr(self.model, "check_data", None)
            if callable(check_data) and self.datamodule is not None:
                check_data(self.datamodule)
            logger = config.get("logger")
            if logger is None or logger is True:
                sub = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
                backend = sub.get("logger_backend", "auto")
                if backend not in _LOGGER_CHOICES:
                    _fail(self.subcommand, f"--logger_backend must be one of {_LOGGER_CHOICES}, got {backend!r}")
                if not config.get("fast_dev_run"):
                    # One directory per run, the trainer's own default_root_dir: the recipe's, or
                    # runs/<recipe> when unset (not the working directory). The CSV metrics, the offline
                    # W&B run (<root>/wandb/) and the checkpoints all go under it.
                    root = config.get("default_root_dir") or os.path.join("runs", self.recipe_name)
                    config["default_root_dir"] = root
                    config["logger"] = _make_default_loggers(backend, root, self.recipe_name)
            configured = config.get("callbacks") or []
            configured = configured if isinstance(configured, list) else [configured]
            sub = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
            cp = sub.get("cp", 1)
            if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
                _fail(self.subcommand, f"--cp must be an int >= 1, got {cp!r}")
            if cp > 1:
                from .lightning.context_parallel import ContextParallel

                # the ranks of a sequence load the same rows; the data modules shard by data-parallel rank
                config["use_distributed_sampler"] = False
                callbacks = [*callbacks, ContextParallel(cp)]
            if config.get("enable_progress_bar") is not False and not any(
                isinstance(cb, ProgressBar) for cb in [*configured, *callbacks]
            ):
                callbacks = [*callbacks, step_progress_bar()]
            return super()._instantiate_trainer(config, callbacks)

    return SparseTrainCLI


def _flat_config(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a (possibly nested) jsonargparse Namespace / dict / dataclass as ``{dotted key: value}``;
    ``init_args`` and ``dict_kwargs`` levels are dropped, so a checkpoint's flat hyperparameters and the
    parsed ``class_path`` / ``init_args`` config name the same setting alike."""
    if hasattr(node, "as_dict"):
        node = node.as_dict()
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = dataclasses.asdict(node)
    if not isinstance(node, dict):
        return {prefix: node} if prefix else {}
    leaves: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("class_path", "_class_path", "_instantiator"):
            continue
        name = prefix if key in ("init_args", "dict_kwargs") else (f"{prefix}.{key}" if prefix else key)
        leaves.update(_flat_config(value, name))
    return leaves


@contextlib.contextmanager
def _held_logs(name: str) -> Iterator[list[logging.LogRecord]]:
    """Hold back the records of logger ``name`` inside the block; the caller may re-emit them."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    logger = logging.getLogger(name)
    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)


@contextlib.contextmanager
def _offline_env() -> Iterator[None]:
    # Set before any wandb import: an offline run never opens a socket to the W&B servers.
    os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_DISABLE_GIT", "true")
    yield


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``sparse-train`` console script; ``args`` defaults to ``sys.argv[1:]``.
    Returns None (a console script's return value becomes its exit status)."""
    run_cli(args)


def run_cli(args: Sequence[str] | None = None, run: bool = True) -> Any:
    """Run the CLI and return the ``LightningCLI`` object (its ``trainer``, ``model``, ``datamodule``);
    for tests and notebooks. ``args`` is the whole command line without the program name; ``None`` reads
    ``sys.argv``. A bad argument or config value raises ``SystemExit`` with a one-line message."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] in (["recipes"], ["--list-recipes"]):
        _print_recipes()
        return None
    if argv[:1] == ["export"]:
        return export_hf(argv[1:])
    with _offline_env():
        from lightning.pytorch import LightningDataModule, LightningModule

        cls = _cli_class()
        cls.recipe_name = _recipe_name(argv)
        return cls(
            model_class=LightningModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            # None lets Lightning read sys.argv itself; recipe names are resolved by the --config action.
            args=None if args is None else argv,
            run=run,
            save_config_kwargs={"overwrite": True},
            parser_class=cls.argument_parser_class,
            parser_kwargs={
                "prog": "sparse-train",
                "description": "sparse-train: learned block-sparse attention training",
            },
        )


if __name__ == "__main__":
    main()
