"""The package's shape: layers that import downward only, no cycles, small modules with a job."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "amp_exp"
MAX_LINES = 400
# Lowest first. A module may import from its own layer or a lower one. The config schema, the
# precision table and the errors are leaves every layer may use; the rest of config/ composes and
# checks configs, which needs the runtime's resolvers and launchers.
LAYERS = [
    (
        "amp_exp.errors",
        "amp_exp.config.schema",
        "amp_exp.config.datasets",
        "amp_exp.config.precisions",
    ),
    ("amp_exp.runtime",),
    ("amp_exp.config",),
    ("amp_exp.tasks",),
    ("amp_exp.training",),
    ("amp_exp.results",),
    ("amp_exp.report",),
    # Entry points and the composition root; the speed trial builds runs as training does.
    ("amp_exp.build", "amp_exp.run", "amp_exp.doctor", "amp_exp.speed", "amp_exp.__main__"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The amp_exp modules ``path`` imports, wherever in the file (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(path, known) - {name} for name, path in found.items()}


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no layer; add it to LAYERS"
    return max(matches)[1]


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    graph = import_graph()
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                cycles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in done:
                visit(imported, [*path, imported])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{module} imports {imported}"
        for module, imported_modules in import_graph().items()
        if module != "amp_exp"
        for imported in imported_modules
        if imported != "amp_exp" and layer_of(imported) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_schema_and_the_errors_are_leaves() -> None:
    graph = import_graph()
    assert graph["amp_exp.errors"] == set()
    assert graph["amp_exp.config.datasets"] == set()
    assert graph["amp_exp.config.schema"] == {"amp_exp.config.datasets"}
    assert graph["amp_exp.config.precisions"] == {"amp_exp.config.schema"}


def test_every_module_is_short_and_says_its_job() -> None:
    for name, path in modules().items():
        text = path.read_text()
        assert len(text.splitlines()) <= MAX_LINES, f"{name} has over {MAX_LINES} lines"
        if text.strip() and path.name != "__init__.py":
            assert ast.get_docstring(ast.parse(text)), f"{name} has no module docstring"


def test_the_engine_names_no_task() -> None:
    engine = (PACKAGE / "training" / "engine.py").read_text().lower()
    for word in ("image", "label", "cross_entropy", "accuracy", "argmax", "logits", "token"):
        assert word not in engine, word


def test_the_top_level_holds_few_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top
