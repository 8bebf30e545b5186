"""Names that do not collide: no module basename twice in the packages, no two classes of
one name (a reader who greps a name finds one thing). The one exception is the public
``MonitorCallback`` of each framework integration, whose name each framework's users
expect (docs/contract.md, Markers API)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("markers", "sidecar")
PUBLIC_PER_FRAMEWORK = {"MonitorCallback"}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_module_basename_is_used_twice() -> None:
    names = Counter(p.name for p in _modules() if p.name != "__init__.py")
    assert [name for name, n in names.items() if n > 1] == []


def test_no_two_classes_share_a_name() -> None:
    classes = Counter(
        node.name
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
    )
    doubled = {name for name, n in classes.items() if n > 1} - PUBLIC_PER_FRAMEWORK
    assert doubled == set()
