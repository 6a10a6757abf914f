"""The project's layout rules, read from the source with ``ast`` (nothing is imported or run):

1. no import cycle among the modules of ``p2p_spes`` and ``dht`` (module-level imports, ``from`` imports
   and what package ``__init__`` files import included);
2. no project module imported inside a function (a lazy import hides a dependency, and usually a cycle);
3. no module over ``MAX_MODULE_LINES`` lines;
4. no class over ``MAX_CLASS_LINES`` lines;
5. ``p2p_spes.averaging`` stands alone: nothing it imports (transitively) is the swarm, the trainer or the
   model;
6. the product (``p2p_spes``, ``dht``) never imports the lab or the benchmarks, and no file patches
   ``sys.path``;
7. one module owns each run file: ``metrics.jsonl`` (``metrics_log``) and ``summary.json``
   (``run_summary``);
8. every exception class the project defines derives from ``P2PSpesError``.

Imports under ``if TYPE_CHECKING:`` never run and are left out of the graph.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2p_spes", "dht")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300
# (module, imported project module) pairs allowed inside a function, each with the reason next to it.
# None for project modules: a lazy import of one is a layering problem to fix, not to list.
ALLOWED_FUNCTION_IMPORTS: dict[tuple[str, str], str] = {}


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int
    imports: set[str] = field(default_factory=set)  # project modules imported when this one is
    function_imports: list[tuple[int, str]] = field(default_factory=list)  # (line, project module)


def parse(source: str, filename: str = "<probe>") -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's "AST constructor recursion depth mismatch": a
    SystemError from the interpreter's AST conversion, seen once in a full CI run after the
    multi-process tests (threads they leave running in this process share the recursion state); a second
    parse of the same source succeeds."""
    for attempt in range(3):
        try:
            return ast.parse(source, filename=filename)
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(name: str, modules: dict[str, Module]) -> bool:
    return name in modules and modules[name].path.name == "__init__.py"


def resolve(node: ast.Import | ast.ImportFrom, importer: str, modules: dict[str, Module]) -> set[str]:
    """The project modules an import statement runs: the most specific module each name denotes (a
    submodule for ``from pkg import sub``, else the module or package the names come from)."""
    if isinstance(node, ast.Import):
        targets = {alias.name for alias in node.names}
    else:
        base = node.module or ""
        if node.level:  # relative: up from the importer's package
            package = importer if is_package(importer, modules) else importer.rpartition(".")[0]
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        targets = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    found = set()
    for target in targets:
        while target and target not in modules:  # `import p2p_spes.x.y` where only p2p_spes.x is ours
            target = target.rpartition(".")[0]
        if target and target.split(".")[0] in PACKAGES:
            found.add(target)
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def collect(module: Module, modules: dict[str, Module]) -> None:
    """Fill ``module.imports`` (run at import time) and ``module.function_imports`` (run in a function)."""

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    walk(ast.Module(body=[sub], type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in resolve(child, module.name, modules):
                    if in_function:
                        module.function_imports.append((child.lineno, target))
                    elif target != module.name:
                        module.imports.add(target)
                continue
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(module.tree, False)


@cache
def project() -> dict[str, Module]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            name = module_name(path)
            modules[name] = Module(name, path, parse(source, filename=str(path)), len(source.splitlines()))
    for module in modules.values():
        collect(module, modules)
    return modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    found = []
    for component in components:
        inside = set(component)
        start = component[0]
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats: that closes a cycle
            step = min(w for w in graph[path[-1]] if w in inside)
            if step in seen:
                found.append([*path[path.index(step) :], step])
                break
            path.append(step)
            seen.add(step)
    return found


def test_the_import_graph_is_read_correctly():
    """The reader itself: relative imports, ``from pkg import submodule``, re-exports through a package,
    TYPE_CHECKING and function-level imports, on the real tree."""
    modules = project()
    assert "p2p_spes.swarm" in modules and is_package("p2p_spes.swarm", modules)
    tree = parse("from . import placement\nfrom .config import Config\nimport p2p_spes.errors.x\n")
    got = set()
    for node in tree.body:
        got |= resolve(node, "p2p_spes.train", modules)
    assert got == {"p2p_spes.placement", "p2p_spes.config", "p2p_spes.errors"}
    probe = Module(
        "p2p_spes.probe",
        ROOT / "p2p_spes" / "probe.py",
        parse(
            "from typing import TYPE_CHECKING\nimport torch\nif TYPE_CHECKING:\n    from p2p_spes.model import X\n"
            "from p2p_spes.moe import TorchMoE\ndef f():\n    from p2p_spes.data import TokenDataset\n    import yaml\n"
        ),
        8,
    )
    collect(probe, modules)
    assert probe.imports == {"p2p_spes.moe"} and probe.function_imports == [(7, "p2p_spes.data")]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = {name: module.imports for name, module in project().items()}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_no_project_imports_inside_functions():
    lazy = [
        f"{module.path.relative_to(ROOT)}:{line} imports {target}"
        for module in project().values()
        for line, target in module.function_imports
        if (module.name, target) not in ALLOWED_FUNCTION_IMPORTS
    ]
    assert not lazy, "project modules imported inside a function (import them at module level):\n" + "\n".join(lazy)


def test_no_module_is_too_long():
    long = [f"{m.path.relative_to(ROOT)}: {m.lines} lines" for m in project().values() if m.lines > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them):\n" + "\n".join(long)


def test_no_class_is_too_long():
    long = [
        f"{m.path.relative_to(ROOT)}:{node.lineno} class {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for m in project().values()
        for node in ast.walk(m.tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not long, f"classes over {MAX_CLASS_LINES} lines (split them):\n" + "\n".join(long)


def test_dht_sits_below_the_trainer():
    """``dht`` uses of ``p2p_spes`` only ``config`` and ``errors``, and nothing those import (transitively)
    imports ``dht``: the two packages form layers, not a cycle."""
    modules = project()
    allowed = {"p2p_spes.config", "p2p_spes.errors"}
    for name, module in modules.items():
        if name.split(".")[0] == "dht":
            used = {m for m in module.imports if m.startswith("p2p_spes")}
            assert used <= allowed, f"{name} imports {sorted(used - allowed)} of the trainer"
    todo, seen = list(allowed), set()
    while todo:
        name = todo.pop()
        seen.add(name)
        assert not any(m.split(".")[0] == "dht" for m in modules[name].imports), f"{name} imports dht"
        todo += [m for m in modules[name].imports if m not in seen]


# what the averaging package may not reach: the swarm's rounds, the trainer, the model and its data
NOT_BELOW_AVERAGING = (
    "p2p_spes.swarm",
    "p2p_spes.train",
    "p2p_spes.model",
    "p2p_spes.moe",
    "p2p_spes.peer",
    "p2p_spes.optim",
    "p2p_spes.data",
)
RUN_FILES = {"metrics.jsonl": "p2p_spes/metrics_log.py", "summary.json": "p2p_spes/run_summary.py"}


def reachable(start: str, modules: dict[str, Module]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += sorted(modules[name].imports)
    return seen


def test_the_averaging_package_stands_alone():
    modules = project()
    inside = [name for name in modules if name.startswith("p2p_spes.averaging")]
    assert "p2p_spes.averaging.allreduce" in inside and "p2p_spes.averaging.compression" in inside
    bad = {
        f"{name} reaches {other}"
        for name in inside
        for other in reachable(name, modules)
        if other.startswith(NOT_BELOW_AVERAGING)
    }
    assert not bad, "the averaging package imports the swarm, trainer or model:\n" + "\n".join(sorted(bad))


def python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def imported_names(tree: ast.Module) -> list[tuple[int, str]]:
    """Every module name an ``import`` statement names, at any depth (absolute imports only)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.lineno, node.module))
    return out


def test_the_product_does_not_import_the_lab():
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in python_files(*PACKAGES)
        for line, name in imported_names(parse(path.read_text(encoding="utf-8")))
        if name.split(".")[0] in ("benchmarks", "tests", "helpers")
    ]
    assert not bad, "the installed package imports the lab or the tests:\n" + "\n".join(bad)


def test_no_file_patches_sys_path():
    bad = []
    for path in python_files(*PACKAGES, "benchmarks", "tests", "launch"):
        for node in ast.walk(parse(path.read_text(encoding="utf-8"))):
            func = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "path"
                and isinstance(func.value.value, ast.Name)
                and func.value.value.id == "sys"
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "sys.path is patched (run scripts as `python -m benchmarks.<name>`):\n" + "\n".join(bad)


def docstring_nodes(tree: ast.Module) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_one_module_owns_each_run_file():
    """Only the owner builds a path to ``metrics.jsonl`` or ``summary.json`` (messages and docstrings may
    mention them)."""
    bad = []
    for path in python_files(*PACKAGES, "benchmarks"):
        tree = parse(path.read_text(encoding="utf-8"))
        docs = docstring_nodes(tree)
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in docs and isinstance(node.value, str):
                owner = RUN_FILES.get(node.value)  # the file's name as a path part, not a message naming it
                if owner is not None and rel != owner:
                    bad.append(f"{rel}:{node.lineno} names {node.value!r} (use {owner})")
    assert not bad, "run files read or written outside their module:\n" + "\n".join(bad)


def test_the_project_errors_share_one_root():
    errors = parse((ROOT / "p2p_spes" / "errors.py").read_text(encoding="utf-8"))
    root = "P2PSpesError"
    assert root in {node.name for node in errors.body if isinstance(node, ast.ClassDef)}
    ours: dict[str, list[str]] = {}
    for path in python_files(*PACKAGES):
        for node in ast.walk(parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                ours[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]

    def derives(name: str, depth: int = 0) -> bool:
        return name == root or (depth < 10 and any(derives(b, depth + 1) for b in ours.get(name, [])))

    errors_defined = [
        n for n, bases in ours.items() if n != root and any(b.endswith(("Error", "Exception")) for b in bases)
    ]
    assert "TransportError" in errors_defined and "ConfigError" in errors_defined
    bad = sorted(n for n in errors_defined if not derives(n))
    assert not bad, f"exceptions not derived from {root}: {bad}"
