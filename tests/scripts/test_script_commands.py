"""Every maintained script under scripts/ runs as the command its docstring gives: the module imports as a package
module, its docstring names its own ``-m`` command, ``--help`` exits cleanly; the shell runners parse, and every
script module, file and test path they name exists; the GPU runner's header documents exactly the phases it runs."""

import importlib
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = {"scripts.bench.harness", "scripts.bench.inputs"}  # imported by the benchmarks, no command of their own
MODULES = [
    name
    for name in sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for sub in ("bench", "tools")
        for path in (ROOT / "scripts" / sub).glob("*.py")
        if path.name != "__init__.py"
    )
    if name not in SHARED
]
SHELL = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "scripts").rglob("*.sh"))


def test_the_scripts_are_found():
    assert {"scripts.bench.attention", "scripts.tools.fsdp_check"} <= set(MODULES)
    assert "scripts/tools/gpu_all.sh" in SHELL


@pytest.mark.parametrize("name", MODULES)
def test_help_and_documented_command(name, capsys):
    module = importlib.import_module(name)
    assert f"-m {name}" in module.__doc__, f"{name}'s docstring does not give its command"
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("path", SHELL)
def test_shell_runner_parses_and_names_existing_paths(path):
    subprocess.run(["bash", "-n", str(ROOT / path)], check=True)
    text = (ROOT / path).read_text()
    for module in set(re.findall(r"-m (scripts(?:\.\w+)+)", text)):
        assert importlib.util.find_spec(module) is not None, f"{path} runs {module}, which does not exist"
    for file in set(re.findall(r"\b((?:scripts|tests|recipes)/[\w/.-]+\.(?:py|sh|yaml))\b", text)):
        assert (ROOT / file).is_file(), f"{path} names {file}, which does not exist"


def test_gpu_runner_documents_exactly_the_phases_it_runs():
    text = (ROOT / "scripts/tools/gpu_all.sh").read_text()
    documented = set(re.findall(r"^#   OUT=\S+ bash scripts/tools/gpu_all\.sh (\w+)", text, flags=re.M))
    body = text[text.index('case "$phase" in') :]
    branches = {name for labels in re.findall(r"^  ([\w|]+)\)", body, flags=re.M) for name in labels.split("|")}
    print(f"documented: {sorted(documented)}\nbranches:   {sorted(branches)}")
    assert documented and documented == branches
