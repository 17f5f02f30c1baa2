"""The tree's shape: no import cycles, and nothing lower imports anything higher (the runner, the
model and the step leaf never import the engine or the server)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tokenloom"


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = package.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            # `from pkg import submodule` imports the submodule, not what pkg/__init__ imports
            targets = submodules if len(submodules) == len(node.names) else [target, *submodules]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_cycles():
    graph, state, cycles = import_graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_lower_layers_do_not_import_higher_ones():
    graph = import_graph()
    for module, imports in graph.items():
        if module in ("tokenloom.runner", "tokenloom.step") or module.startswith("tokenloom.model"):
            higher = {m for m in imports if m.startswith(("tokenloom.engine", "tokenloom.server", "tokenloom.llm"))}
            assert not higher, (module, higher)
