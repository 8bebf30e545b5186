"""Headers the contract (docs/contract.md) spells out, written here once for the tests
that check the files against them."""

from __future__ import annotations

import re
from pathlib import Path

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "contract.md"

# computational.tsv's header, in the contract's order (custom phases follow).
STANDARD_COLUMNS = [
    "measurement #",
    "Training (s)",
    "Epoch (s)",
    "Training loop (s)",
    "Training data loading (s)",
    "Forward (s)",
    "Forward GPU (s)",
    "Forward GPU max memory (MB)",
    "Backward (s)",
    "Backward GPU (s)",
    "Backward GPU max memory (MB)",
    "Optimization (s)",
    "Optimization GPU (s)",
    "Optimization GPU max memory (MB)",
    "Validation (s)",
    "Validation loop (s)",
    "Validation data loading (s)",
    "Evaluation (s)",
    "Evaluation GPU (s)",
    "Evaluation GPU max memory (MB)",
    "Metrics computation (s)",
    "Metrics computation GPU (s)",
    "Metrics computation GPU max memory (MB)",
]


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
