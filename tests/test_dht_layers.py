"""The ``dht`` package is layered: no import cycle, no project import hidden inside a function, and of
``p2p_spes`` only ``config`` and ``errors`` (which import nothing of ``dht``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED_FROM_TRAINER = {"p2p_spes.config", "p2p_spes.errors"}


def _imports(path: Path) -> tuple[set[str], list[int]]:
    """Project modules imported at module level, and the lines of project imports inside functions."""
    tree = ast.parse(path.read_text())
    top, nested = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        names = [n for n in names if n.split(".")[0] in ("dht", "p2p_spes")]
        if node in tree.body:
            top.update(names)
        elif names:
            nested.append(node.lineno)
    return top, nested


def test_dht_has_no_cycles_nor_function_level_project_imports():
    graph = {}
    for path in sorted((ROOT / "dht").glob("*.py")):
        top, nested = _imports(path)
        assert not nested, f"{path.name}: project import inside a function at line(s) {nested}"
        graph[f"dht.{path.stem}"] = top
        assert {m for m in top if m.startswith("p2p_spes")} <= ALLOWED_FROM_TRAINER, path.name

    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        for dep in graph.get(module, ()):
            assert dep not in stack, f"import cycle: {' -> '.join([*stack, dep])}"
            if dep in graph and dep not in done:
                visit(dep, [*stack, dep])
        done.add(module)

    for module in graph:
        visit(module, [module])


def test_the_trainer_modules_dht_uses_do_not_import_dht():
    """No cycle between the packages: what dht imports of p2p_spes reaches no dht module, even lazily."""
    todo, seen = list(ALLOWED_FROM_TRAINER), set()
    while todo:
        module = todo.pop()
        seen.add(module)
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.split(".")[0] == "dht" for n in names), f"{module} imports {names}"
            todo += [n for n in names if n.startswith("p2p_spes.") and n not in seen]
