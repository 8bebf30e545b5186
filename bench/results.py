"""Each benchmark owns one ``## `` section of bench/RESULTS.md and replaces only that."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().with_name("RESULTS.md")


def machine_line(command: str) -> str:
    """Where and when a table was measured, for the line under a section heading."""
    return (
        f"`{command}` on {platform.node()} ({os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}), {time.strftime('%Y-%m-%d')}."
    )


def write_section(text: str, path: Path = RESULTS, first: bool = False) -> None:
    """Replace the section of ``path`` whose heading is the first line of ``text`` (up to
    the next ``## `` heading), or append it (``first``: put it before every other
    section); the file is created when absent.
    """
    heading = text.splitlines()[0].rstrip()
    old = path.read_text() if path.exists() else "# Benchmark results\n\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None and first:
        at = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
        head = "".join(lines[:at]).rstrip("\n")
        new = head + "\n\n" + text.rstrip("\n") + "\n\n" + "".join(lines[at:])
    elif start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + text.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new.rstrip("\n") + "\n")
    tmp.replace(path)
