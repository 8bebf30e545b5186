"""Headers the contract (docs/contract.md) spells out, read from it once for the tests
that check the files against them: the contract is the one place they are written."""

from __future__ import annotations

import re
from pathlib import Path

CONTRACT = Path(__file__).parents[2] / "docs" / "contract.md"


def _computational_header() -> list[str]:
    """computational.tsv's header as the contract's row for the file states it: its first
    column, then "exactly these N columns in this order: `...`, ...; then" (checked: N)."""
    row = next(
        line
        for line in CONTRACT.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `training/split-<k>/logs/computational.tsv` |")
    )
    stated = re.search(
        r"first column `([^`]+)`.*? exactly these (\d+) columns in this order: (.+?); then", row
    )
    assert stated is not None, "the contract's computational.tsv row no longer reads as expected"
    columns = re.findall(r"`([^`]+)`", stated[3])
    assert len(columns) == int(stated[2]), f"the contract counts {stated[2]}, lists {len(columns)}"
    return [stated[1], *columns]


# computational.tsv's header, in the contract's order (custom phases follow).
STANDARD_COLUMNS = _computational_header()
