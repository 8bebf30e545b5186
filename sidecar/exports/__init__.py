"""Exports of a split's figures to the tools users already read (docs/exports.md):
TensorBoard event files, an MLflow run and a W&B run, step-aligned, written by the sidecar.

Each exporter is an optional extra built on the tool's own library. This module names
them and says, without importing any, which of the names asked for can be used.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

# name -> (the module its library provides, the extra that installs it)
EXPORTERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "trainmon[tensorboard]"),
    "mlflow": ("mlflow", "trainmon[mlflow]"),
    "wandb": ("wandb", "trainmon[wandb]"),
}


def installed(name: str) -> bool:
    """Whether the library of exporter ``name`` (a key of ``EXPORTERS``) can be imported
    (looked up, not imported: an idle sidecar stays light)."""
    try:
        return importlib.util.find_spec(EXPORTERS[name][0]) is not None
    except (ImportError, ValueError):
        return False


def choose(names: Iterable[str]) -> tuple[tuple[str, ...], str | None]:
    """The usable exporters among ``names`` (in order, once each) and one warning for
    the others (None when every name is usable): an unknown name, or one whose library
    is not installed, with the extra to install."""
    usable: list[str] = []
    problems: list[str] = []
    for name in dict.fromkeys(n.strip().lower() for n in names if n.strip()):
        if name not in EXPORTERS:
            known = ", ".join(EXPORTERS)
            problems.append(f"unknown export {name!r} (known: {known})")
        elif not installed(name):
            problems.append(
                f"export {name!r} needs its library: pip install '{EXPORTERS[name][1]}'"
            )
        else:
            usable.append(name)
    warning = "; ".join(problems) + "; the run goes on without them" if problems else None
    return tuple(usable), warning


def parse_list(text: str) -> list[str]:
    """``--export``'s value, comma-separated names, as a list ('' or 'none': none)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return [] if names == ["none"] else names
