"""The package's shape: layers that import downward only, no cycles, small modules with a job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "amp_exp"
# The code whose imports are checked: the package and the Hydra plugins it registers.
PACKAGES = (PACKAGE, ROOT / "hydra_plugins")
# The map of the house (docs/architecture.md draws it). Lowest first. A module may import from its
# own layer or a lower one. The config schema, the precision and device tables, the worker's rank
# (its resolvers compose the run directory) and the errors are leaves every layer may use; the
# rest of config/ composes and checks configs, and sits below the runtime.
LAYERS = [
    (
        "amp_exp.errors",
        "amp_exp.config.schema",
        "amp_exp.devices",
        "amp_exp.launch",
        "amp_exp.config.datasets",
        "amp_exp.config.models",
        "amp_exp.config.adaptive",
        "amp_exp.config.precisions",
    ),
    ("amp_exp.config",),
    ("amp_exp.runtime",),
    ("amp_exp.tasks",),
    ("amp_exp.training",),
    ("amp_exp.results",),
    # Reads a run's rows as the report does; the report shows its forecasts.
    ("amp_exp.forecast",),
    # The sweepers and launchers Hydra instantiates: they launch jobs and place them
    # (results/placement.py); the entry point registers them and hands the evidence sweeper the
    # report's looks, so they sit below the report and never read it.
    ("hydra_plugins",),
    ("amp_exp.report",),
    # What is fast here: the probe, its cache, the device's verdicts and precision=auto. It reads
    # the speed trial's rule (report/decision.py); the composition root hands it the trial's method.
    ("amp_exp.capability",),
    # Entry points and the composition root; the speed trial builds runs as training does, and
    # the prediction builds their models on the meta device.
    (
        "amp_exp.build",
        "amp_exp.run",
        "amp_exp.doctor",
        "amp_exp.speed",
        "amp_exp.predict",
        "amp_exp.__main__",
    ),
    # It verifies its repairs with real runs (amp_exp.run), so it sits above the composition root.
    ("amp_exp.sensitivity",),
    # Other trainers' runs, recorded with the audit and written in the results format.
    ("amp_exp.integrations",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        module_name(path): path for package in PACKAGES for path in sorted(package.rglob("*.py"))
    }


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


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` that runs up the layers."""
    return [
        f"{module} imports {imported}"
        for module, imported_modules in graph.items()
        if module != "amp_exp"
        for imported in imported_modules
        if imported != "amp_exp" and layer_of(imported) > layer_of(module)
    ]


def test_imports_point_down_the_layers() -> None:
    found = upward(import_graph())
    assert not found, "\n".join(found)


def test_a_plugin_reading_the_report_or_config_registering_a_plugin_runs_up() -> None:
    """The two imports that once ran back up: the evidence sweeper importing the report's
    internals, and config/store.py importing the plugins to register them."""
    planted = {
        "hydra_plugins._amp_exp_evidence": {"amp_exp.report.assemble", "amp_exp.results.files"},
        "amp_exp.config.store": {"hydra_plugins._amp_exp_submitit"},
        "amp_exp.__main__": {"hydra_plugins._amp_exp_evidence"},
    }
    assert upward(planted) == [
        "hydra_plugins._amp_exp_evidence imports amp_exp.report.assemble",
        "amp_exp.config.store imports hydra_plugins._amp_exp_submitit",
    ]


def test_the_plugins_are_checked_and_registered_only_by_the_entry_point() -> None:
    graph = import_graph()
    assert {"hydra_plugins._amp_exp_evidence", "hydra_plugins._amp_exp_submitit"} <= set(graph)
    importers = {m for m, uses in graph.items() if any(i.startswith("hydra_plugins") for i in uses)}
    assert importers == {"amp_exp.__main__"}


def test_the_schema_and_the_errors_are_leaves() -> None:
    graph = import_graph()
    assert graph["amp_exp.errors"] == set()
    assert graph["amp_exp.config.datasets"] == set()
    assert graph["amp_exp.config.models"] == set()
    assert graph["amp_exp.config.adaptive"] == set()
    assert graph["amp_exp.devices"] == set()
    assert graph["amp_exp.launch"] == {"amp_exp.errors"}
    assert graph["amp_exp.config.schema"] == {
        "amp_exp.config.adaptive",
        "amp_exp.config.datasets",
        "amp_exp.config.models",
    }
    # The registry loads the plugins by name (as it does a user's); its own imports are leaves.
    assert graph["amp_exp.config.precisions"] == {"amp_exp.config.schema", "amp_exp.errors"}


def test_every_module_says_its_job() -> None:
    """One idea per module (README's Layout), said in its docstring; no line count, which split
    one idea over several files."""
    for name, path in modules().items():
        text = path.read_text()
        if text.strip() and path.name != "__init__.py":
            assert ast.get_docstring(ast.parse(text)), f"{name} has no module docstring"


# What only a task knows: its data, its loss, its metrics and the unit its throughput counts.
TASK_WORDS = ("image", "label", "cross_entropy", "accuracy", "argmax", "logits", "token", "unit")


def code_names(tree: ast.AST) -> set[str]:
    """Every name the code uses: identifiers, attributes, imported names and string constants
    (a key such as ``f"{unit}_per_s"``), but not comments or docstrings."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            names.add(node.value)
    return names


def test_the_engine_names_no_task() -> None:
    names = code_names(ast.parse((PACKAGE / "training" / "engine.py").read_text()))
    leaks = sorted(name for name in names for word in TASK_WORDS if word in name.lower())
    assert not leaks, leaks
    graph = import_graph()
    assert not {m for m in graph["amp_exp.training.engine"] if m.startswith("amp_exp.tasks.")} - {
        "amp_exp.tasks.base"
    }


def test_the_task_word_check_sees_code_and_not_comments() -> None:
    tree = ast.parse('"""A doc about tokens."""\n# logits here\nrow[f"{unit}_per_s"] = token\n')
    assert {"unit", "_per_s", "token"} <= code_names(tree)
    assert not any("logits" in name or "tokens." in name for name in code_names(tree))


def test_paths_cited_in_configs_docs_and_code_exist() -> None:
    root = PACKAGE.parent
    cited = set()
    for path in [*root.glob("conf/**/*.yaml"), *root.glob("docs/*.md"), root / "README.md"]:
        cited |= set(re.findall(r"amp_exp/[\w/]+\.py", path.read_text()))
    for path in PACKAGE.rglob("*.py"):
        cited |= set(re.findall(r"amp_exp/[\w/]+\.py", path.read_text()))
    assert not sorted(p for p in cited if not (root / p).is_file())


def test_the_top_level_holds_few_modules() -> None:
    """The top level holds the entry points and composition root (__main__, build, run, doctor)
    and the leaves every layer reads (errors, devices, launch); anything else belongs in a
    layer's folder."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_the_architecture_page_describes_every_room_of_the_map() -> None:
    """docs/architecture.md is drawn from ``LAYERS``: a room added to the map and not to the
    page (or a page that lost one) fails here."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rooms = {
        prefix.split(".")[1] if prefix.startswith("amp_exp.") else prefix
        for layer in LAYERS
        for prefix in layer
    }
    missing = [
        room
        for room in sorted(rooms)
        if f"`{room}/`" not in page and f"`{room}.py`" not in page and f"{room}.py" not in page
    ]
    assert not missing, missing
