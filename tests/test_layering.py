"""The package's import structure: no import circle between flce's modules, and every package
imports only from its own layer or the layers below it (docs/architecture.md's layout, bottom to top).

Every import counts, at module level or inside a function (a lazy import is still a dependency);
read from the source with ast, so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flce"

# Bottom to top; a module belongs to the first (most specific) prefix that matches it. The cache
# half of flce.autotune (lookup, schema, files, the tuning-space registry) sits below the backends,
# which read tuned knobs and register their spaces; its tuner and CLI run the public API, at the top.
LAYERS: list[tuple[str, ...]] = [
    ("flce.config", "flce.outputs", "flce.errors", "flce.devices", "flce.policy.options"),
    ("flce.inputs", "flce.testing", "flce.policy.tokens"),
    ("flce.semantics", "flce.gradients", "flce.distillation", "flce.policy"),
    ("flce.autotune",),
    ("flce.registry",),
    ("flce.engine",),
    ("flce.backends",),
    ("flce.distributed",),
    ("flce.module", "flce.distillation.api", "flce.policy.api"),
    ("flce", "flce.__main__", "flce.integrations",
     "flce.autotune.tuner", "flce.autotune.workload", "flce.autotune.measurement", "flce.autotune.cli",
     "flce.autotune.__main__"),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """flce modules that ``name`` imports (``from pkg import mod`` counts as an import of pkg.mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _layer(module: str) -> int:
    best, depth = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    assert best is not None, f"{module} is in no layer of tests/test_layering.py"
    return best


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [module, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_package_imports_a_layer_above_it() -> None:
    upward = [f"{module} (layer {_layer(module)}) imports {dep} (layer {_layer(dep)})"
              for module, deps in sorted(_graph().items()) for dep in sorted(deps) if _layer(dep) > _layer(module)]
    assert not upward, "\n".join(upward)


def test_no_module_over_400_lines() -> None:
    long = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert not {n: c for n, c in long.items() if c >= 400}, sorted(long.items(), key=lambda kv: -kv[1])[:3]


def test_the_check_sees_a_circle() -> None:
    """The graph builder resolves the import forms flce uses (absolute, from-package-import-module)."""
    graph = _graph()
    assert "flce.engine.schedule" in graph["flce.engine.run"]
    assert "flce.backends.cuda.tuning" in graph["flce.backends.cuda"]
    assert "flce.backends.cuda.families" in graph["flce.backends.cuda.ops"]


def test_cuda_launchers_reach_no_planner_and_no_schedule() -> None:
    """The CUDA launchers launch what the kernel choice says: none of them imports, even indirectly, the
    planner (cuda/plan.py, choice.py, steps.py) or an engine schedule (engine -> backend -> engine)."""
    graph = _graph()
    planner = {"flce.backends.cuda.plan", "flce.backends.cuda.choice", "flce.backends.cuda.steps",
               "flce.backends.cuda.tuning", "flce.engine.schedule", "flce.engine.all_rows",
               "flce.engine.token_chunks", "flce.engine.vocab_blocks"}
    launchers = [m for m in graph if m.startswith("flce.backends.cuda.") and m.endswith("ops")]
    assert "flce.backends.cuda.ops" in launchers
    for launcher in launchers:
        reached, todo = set(), [launcher]
        while todo:
            for dep in graph[todo.pop()] - reached:
                reached.add(dep)
                todo.append(dep)
        assert not reached & planner, f"{launcher} reaches {sorted(reached & planner)}"
