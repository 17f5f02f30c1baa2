"""The tree's shape: no import cycles, and the layers in order — a module imports only from its own layer
or the ones below it (`LAYERS`, lowest first).

What counts as an import: every `import x` and `from x import y` of a tokenloom module anywhere in a
module, at its top or inside a function or a method (a function-level import runs too, only later:
it is still a dependency, and the layers are about what may depend on what). Not counted: the ones
under `if TYPE_CHECKING:` (annotations only, never executed). `from pkg import name` is an import of
the submodule `pkg.name` when there is one, else of `pkg`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tokenloom"

# Lowest first. A module belongs to the layer of the longest name in it that is the module's own or one of
# its packages' (a package names all of its modules; the root `tokenloom` names only its __init__);
# every module must have one, so a new module is placed on purpose.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Leaves every layer may use: the configuration, a request's parameters and outputs, structured
    # output (grammars), and small helpers. `tokenloom` itself (its __init__) runs before any of its
    # modules, so it is here, importing its public names (LLM, ...) only when they are first used.
    ("base", ("tokenloom", "tokenloom.config", "tokenloom.sampling_params", "tokenloom.outputs",
              "tokenloom.structured_output", "tokenloom.token_sets", "tokenloom.faults",
              "tokenloom.request_checks", "tokenloom.slo", "tokenloom.process_memory")),
    ("step", ("tokenloom.step",)),  # the runner seam: Sequence, StepPlan, StepResult
    ("model", ("tokenloom.model",)),
    ("runner", ("tokenloom.runner",)),
    ("engine", ("tokenloom.engine", "tokenloom.llm")),
    ("server", ("tokenloom.server",)),
    # The tools, in two rungs: the fleet (engines on Ray Serve behind the server's app) and the load
    # generator; then what studies serving with them: the simulator (bench's workloads and replay,
    # the fleet's routing policies) and the batching lab (bench's workloads and replay).
    ("tools: fleet, bench", ("tokenloom.fleet", "tokenloom.bench")),
    ("tools: sim, lab", ("tokenloom.sim", "tokenloom.lab")),
    ("cli", ("tokenloom.cli",)),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(tokenloom module imported, line) for every counted import of module `name`."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = []
            for alias in node.names:
                parts = alias.name.split(".")  # `import a.b.c`: the deepest of a.b.c, a.b, a that is ours
                targets += next(([".".join(parts[:i])] for i in range(len(parts), 0, -1)
                                 if ".".join(parts[:i]) in known), [])
        else:
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            # `from pkg import submodule` imports the submodule, not what pkg/__init__ defines
            targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
        found += [(t, node.lineno) for t in targets if t in known and t != name]
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t, _ in imports_of(name, path, known)} for name, path in known.items()}


def layer_of(module: str) -> int | None:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or (prefix != ROOT.name and module.startswith(prefix + "."))
            if inside and len(prefix) > best:
                best, layer = len(prefix), i
    return layer


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


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert not missing, f"modules with no layer (add them to LAYERS): {missing}"


def test_no_module_imports_a_higher_layer():
    known = modules()
    upward = []
    for name, path in sorted(known.items()):
        here = layer_of(name)
        for target, line in imports_of(name, path, known):
            there = layer_of(target)
            if here is not None and there is not None and there > here:
                upward.append(f"{name} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]}) at "
                              f"{path.relative_to(ROOT.parent)}:{line}")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_layer_test_sees_every_kind_of_import(tmp_path):
    """The walker counts a plain import, a relative one and a function-level one, and skips TYPE_CHECKING."""
    pkg = tmp_path / "tokenloom"
    (pkg / "engine").mkdir(parents=True)
    for name in ("__init__.py", "config.py", "engine/__init__.py", "engine/core.py"):
        (pkg / name).write_text("")
    (pkg / "config.py").write_text(
        "from typing import TYPE_CHECKING\nimport tokenloom.engine.core\nif TYPE_CHECKING:\n"
        "    from .engine import core\ndef f():\n    from .engine.core import x\n")
    known = {n: pkg / p for n, p in (("tokenloom", "__init__.py"), ("tokenloom.config", "config.py"),
                                     ("tokenloom.engine", "engine/__init__.py"),
                                     ("tokenloom.engine.core", "engine/core.py"))}
    assert sorted(imports_of("tokenloom.config", known["tokenloom.config"], known)) == [
        ("tokenloom.engine.core", 2), ("tokenloom.engine.core", 6)]


def test_the_base_layer_loads_neither_torch_nor_llguidance():
    """A request's parameters and the configuration are light: `import tokenloom.sampling_params` (and so
    `tokenloom` itself, which runs first) must not load the engine's heavy dependencies."""
    code = ("import sys, tokenloom.sampling_params, tokenloom.config, tokenloom.outputs; "
            "print(','.join(m for m in ('torch', 'llguidance', 'tokenloom.engine', 'tokenloom.model') "
            "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT.parent).stdout.strip()
    assert loaded == "", loaded


def test_a_plain_serve_neither_loads_ray_nor_paces_it():
    """`tokenloom serve`'s parser carries the fleet's flags, but only a fleet imports Ray and sets Ray
    Serve's pacing (fleet/ray_env.py); the fleet's modules that import Ray set it first."""
    code = ("import os, sys, tokenloom.cli as c; c.build_parser().parse_args(['serve']); "
            "print(sorted(m for m in ('ray', 'tokenloom.fleet.ray_env') if m in sys.modules), "
            "[k for k in os.environ if k.startswith('RAY_SERVE_')]); "
            "import tokenloom.fleet.routing; from tokenloom.fleet import ray_env; "
            "print(all(os.environ[k] == v for k, v in ray_env.SERVE_HOUSEKEEPING.items()))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent, env=env).stdout.split("\n")
    assert out[:2] == ["[] []", "True"], out
    for name in ("app", "client", "ray_router", "replica", "board"):
        text = (ROOT / "fleet" / f"{name}.py").read_text()
        head, found, _ = text.partition("from . import ray_env")
        assert found and "import ray" not in head and "from ray" not in head, name
