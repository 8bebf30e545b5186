"""The summary block's text in-process: cells, line widths, and the replacement of our
block inside a file that holds other people's text."""

from __future__ import annotations

from sidecar.sinks import summary
from sidecar.sinks.layout import WIDTH


def test_cells_and_lines_have_the_reference_widths() -> None:
    assert summary.cell([]) == ""
    assert summary.cell([0.25]) == "2.50e-01 [1]"
    assert summary.cell([1.0, 3.0]).startswith("2.00e+00 ± ")
    assert summary.cell([1.0, 3.0]).endswith(" [2]")
    line = summary.table_line("Forward", "a", "b", "c")
    assert line.index("|") == 23 and line.split(" | ")[1] == "a" + " " * 24
    assert len(summary.TITLE_LINE) == WIDTH and len(summary.STARS) == WIDTH


def test_replace_block_keeps_text_of_others_and_holds_ours_once() -> None:
    ours = [summary.TITLE_LINE, "", "table", summary.STARS, "", "Resources", "x",
            summary.STARS]
    first = summary.replace_block("user line 1\n", ours)
    assert first.splitlines() == ["user line 1", "", *ours]
    again = summary.replace_block(first + "user line 2\n", [*ours[:2], "new", *ours[3:]])
    lines = again.splitlines()
    assert lines.count(summary.TITLE_LINE) == 1 and "new" in lines and "table" not in lines
    assert lines[0] == "user line 1" and lines[-1] == "user line 2"
