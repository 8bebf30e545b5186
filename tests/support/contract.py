"""Headers the contract (docs/contract.md) spells out, read from it once for the tests
that check the files against them: the contract is the one place they are written."""

from __future__ import annotations

import re
from pathlib import Path

CONTRACT = Path(__file__).parents[2] / "docs" / "contract.md"


def _computational_header() -> list[str]:
    """computational.tsv's header as the contract's row for the file states it: "exactly
    these N columns in this order: `...`, ...; then" (checked: N), no index column."""
    row = next(
        line
        for line in CONTRACT.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `training/split-<k>/logs/computational.tsv` |")
    )
    stated = re.search(
        r"no index column.*? exactly these (\d+) columns in this order: (.+?); then", row
    )
    assert stated is not None, "the contract's computational.tsv row no longer reads as expected"
    columns = re.findall(r"`([^`]+)`", stated[2])
    assert len(columns) == int(stated[1]), f"the contract counts {stated[1]}, lists {len(columns)}"
    return columns


# computational.tsv's header, in the contract's order (custom phases follow).
STANDARD_COLUMNS = _computational_header()


def contract_metrics(path: Path = CONTRACT) -> dict[str, tuple[str, list[str]]]:
    """The metric table of docs/contract.md (section "Prometheus metrics"), parsed:
    family name (as prometheus_client's parser names it: a counter without ``_total``) →
    (type, label names). A row may name several metrics; ``same`` repeats the row above's
    labels; a parenthesis after a label lists its values and is dropped."""
    section = path.read_text(encoding="utf-8").split("\n## Prometheus metrics\n", 1)[1]
    table: dict[str, tuple[str, list[str]]] = {}
    labels: list[str] = []
    for line in section.split("\n## ", 1)[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = re.findall(r"`(trainmon_\w+)`", cells[0]) if line.startswith("| `") else []
        if not names:
            continue
        kind = cells[1].split()[0]
        if cells[2] != "same":
            plain = re.sub(r"\([^)]*\)", "", cells[2])
            labels = [label.strip() for label in plain.split(",") if label.strip() != "(none)"]
            labels = [label for label in labels if label and label != "none"]
        for name in names:
            family = name.removesuffix("_total") if kind == "counter" else name
            table[family] = (kind, list(labels))
    return table
