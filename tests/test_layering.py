"""The package's layering, read from its source: no module-level import cycle, few imports inside functions
(each one listed below with its reason), validation imports nothing from the package, and the kernels never
import from the selector."""

import ast
import importlib
import pkgutil
from pathlib import Path

import sparse_train

PACKAGE_ROOT = Path(sparse_train.__file__).parent

# Every import into sparse_train that sits inside a function: (importing module, imported module). Only lazy
# imports of optional heavy parts belong here: the Triton kernels (they import triton and, on CPU, need
# TRITON_INTERPRET=1 set before they are first imported), and the modules that import transformers or set up
# Lightning and W&B after the CLI has put their environment in place.
FUNCTION_LEVEL_IMPORTS = {
    ("sparse_train.kernels", "sparse_train.kernels.triton"),  # triton_kernels(): every Triton kernel, on first use
    ("sparse_train.cli", "sparse_train.integrations.hf"),  # transformers, after the offline environment is set
    ("sparse_train.cli", "sparse_train.lightning"),  # Lightning, after the offline environment is set
    ("sparse_train.cli", "sparse_train.lightning.callbacks"),  # Lightning's progress bars, inside the CLI's run
    ("sparse_train.cli", "sparse_train.lightning.context_parallel"),  # the ContextParallel callback of --cp
    ("sparse_train.lightning.hf", "sparse_train.integrations.hf"),  # transformers, when a HF model is built
}
MAX_FUNCTION_LEVEL_IMPORTS = 10


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported sparse_train module, inside a function) for every import statement of the module at
    ``path``; ``from package import submodule`` names the submodule. Imports under ``if TYPE_CHECKING:``
    never run and are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    visit(orelse, in_function)
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                subs = [f"{target}.{alias.name}" for alias in child.names if f"{target}.{alias.name}" in modules]
                found.extend((module, in_function) for module in (subs or [target]))
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return [(module, inside) for module, inside in found if module.split(".")[0] == "sparse_train"]


def _module_graph() -> dict[str, set[str]]:
    """Module-level import edges between sparse_train modules. Importing ``a.b.c`` runs the ``__init__`` of
    ``a.b`` first, so the edge goes to every package on the way too, except the importer's own packages
    (already being imported when the importer runs)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for target, in_function in _imports(name, path, modules):
            if in_function:
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in modules and step not in own and step != name:
                    graph[name].add(step)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def test_every_module_imports():
    for info in pkgutil.walk_packages(sparse_train.__path__, "sparse_train."):
        importlib.import_module(info.name)


def test_no_module_level_import_cycle():
    assert _cycles(_module_graph()) == []


def test_cycle_detection_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_function_level_imports_are_the_listed_lazy_ones():
    modules = _modules()
    found = {
        (name, target)
        for name, path in modules.items()
        for target, in_function in _imports(name, path, modules)
        if in_function
    }
    assert found - FUNCTION_LEVEL_IMPORTS == set(), "imports inside functions that are not on the list"
    assert FUNCTION_LEVEL_IMPORTS - found == set(), "listed imports that the package does not have"
    count = sum(in_function for name, path in modules.items() for _, in_function in _imports(name, path, modules))
    assert count <= MAX_FUNCTION_LEVEL_IMPORTS, f"{count} imports into the package inside functions"


def test_validation_is_a_leaf():
    modules = _modules()
    assert _imports("sparse_train.validation", modules["sparse_train.validation"], modules) == []


def test_kernels_do_not_import_the_selector():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("sparse_train.kernels"):
            for target, _ in _imports(name, path, modules):
                assert not target.startswith("sparse_train.selection"), (name, target)
