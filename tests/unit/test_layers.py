"""The import graph of the two packages, read from the source with ``ast`` (every import,
also those inside functions and under ``TYPE_CHECKING``): no cycle between sidecar's
modules, each sidecar package imports only itself and the packages of lower layers, and
markers never imports sidecar."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# sidecar's packages from the bottom up: a package may import its own modules and those
# of the layers below it, never one of its own layer or above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("model",),
    ("resources",),
    ("ingest", "sinks"),
    ("exports",),
    ("daemon", "report"),
    ("views",),
    ("cli",),
    ("__main__",),
)
LAYER_OF = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` (a top-level folder of the repository) by dotted name."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The dotted names module ``name`` (at ``path``) imports: for ``from a import b``,
    ``a.b`` when that is a module in ``known``, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in known else base


def graph(package: str) -> dict[str, set[str]]:
    """Per module of ``package``: the modules of the same top-level package it imports."""
    found = modules(package)
    known = set(found)
    return {
        name: {
            target
            for target in imported(name, path, known)
            if target.split(".")[0] == package and target != name
        }
        for name, path in found.items()
    }


def layer(module: str) -> tuple[str, int]:
    """(sidecar package, its layer) of a sidecar module; KeyError for an undeclared one."""
    package = module.split(".")[1] if "." in module else ""
    return package, LAYER_OF[package]


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges`` as a path that comes back to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target, [*path, target])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Each import of a module from its own layer (another package) or a higher one."""
    wrong = []
    for source, targets in sorted(edges.items()):
        if source == "sidecar":
            continue
        package, level = layer(source)
        for target in sorted(targets):
            other, other_level = layer(target)
            if other != package and other_level >= level:
                wrong.append(f"{source} (layer {level}) imports {target} (layer {other_level})")
    return wrong


def test_sidecar_has_no_import_cycle() -> None:
    assert cycle(graph("sidecar")) is None


def test_sidecar_imports_only_downward() -> None:
    edges = graph("sidecar")
    undeclared = {name.split(".")[1] for name in edges if "." in name} - set(LAYER_OF)
    assert not undeclared, f"packages with no layer in LAYERS: {undeclared}"
    assert upward(edges) == []


def test_markers_never_imports_sidecar() -> None:
    found = modules("markers")
    for name, path in found.items():
        assert not [
            target
            for target in imported(name, path, set(found))
            if target.split(".")[0] == "sidecar"
        ], name


@pytest.mark.parametrize(
    ("edges", "found"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], found: list[str] | None) -> None:
    assert cycle(edges) == found


def test_the_layer_check_sees_an_upward_import() -> None:
    edges = {
        "sidecar.sinks.metrics": {"sidecar.daemon.snapshot", "sidecar.model.split"},
        "sidecar.ingest.streams": {"sidecar.sinks.layout"},
    }
    assert upward(edges) == [
        "sidecar.ingest.streams (layer 2) imports sidecar.sinks.layout (layer 2)",
        "sidecar.sinks.metrics (layer 2) imports sidecar.daemon.snapshot (layer 4)",
    ]


# sidecar.sinks renders what the model derived (sidecar.model.derived puts every figure
# the writers print in SplitFigures): it may import the model's types (data shapes) and
# constants, and its state's (de)serialization, never a function that computes figures.
SINKS = sorted(name for name in modules("sidecar") if name.startswith("sidecar.sinks."))
SERIALIZATION = {"sidecar.model.state"}


def model_functions(path: Path) -> list[str]:
    """The functions of sidecar.model a module (at ``path``) imports by name, and the
    modules of it (but its state's serialization) it imports whole."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):  # a whole module: its functions with it
            found += [
                alias.name
                for alias in node.names
                if alias.name.startswith("sidecar.model") and alias.name not in SERIALIZATION
            ]
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sidecar.model"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = (
                    importlib.import_module(full)
                    if full in modules("sidecar")
                    else getattr(module, alias.name)
                )
                if inspect.ismodule(target):
                    if target.__name__ not in SERIALIZATION:
                        found.append(target.__name__)
                elif callable(target) and not inspect.isclass(target):
                    found.append(full)
    return found


@pytest.mark.parametrize("name", SINKS)
def test_the_sinks_import_no_computing_function_of_the_model(name: str) -> None:
    assert model_functions(modules("sidecar")[name]) == []


def test_the_check_sees_a_computing_function() -> None:
    assert model_functions(ROOT / "sidecar" / "model" / "derived.py") != []


def test_the_check_sees_a_whole_module_and_lets_types_and_constants_pass(tmp_path: Path) -> None:
    source = tmp_path / "renderer.py"
    source.write_text(
        "import sidecar.model.stragglers\n"
        "from sidecar.model import efficiency, state\n"
        "from sidecar.model.merge import TABLE_PHASES, MergedSplit\n"
        "from sidecar.model.efficiency import mean\n",
        encoding="utf-8",
    )
    assert model_functions(source) == [
        "sidecar.model.stragglers",
        "sidecar.model.efficiency",
        "sidecar.model.efficiency.mean",
    ]
