"""The summary block's text in-process: cells (the sample standard deviation, pandas'
``Series.std()``, in the stored and the streaming cells), line widths, and the
replacement of our blocks inside a file that holds other people's text, old layout
included."""

from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.model.stats import Welford
from sidecar.sinks import summary
from sidecar.sinks.layout import WIDTH

finite = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False)


def test_cells_and_lines_have_the_reference_widths() -> None:
    assert summary.cell([]) == ""
    assert summary.cell([0.25]) == "2.50e-01 [1]"
    assert summary.cell([1.0, 3.0]).startswith("2.00e+00 ± ")
    assert summary.cell([1.0, 3.0]).endswith(" [2]")
    line = summary.table_line("Forward", "a", "b", "c")
    assert line.index("|") == 23 and line.split(" | ")[1] == "a" + " " * 24
    assert len(summary.TITLE_LINE) == WIDTH and len(summary.STARS) == WIDTH
    assert len(summary.ADDITIONS_LINE) == WIDTH


def test_cells_use_the_sample_std() -> None:
    # Three epochs: at n = 3 the population std (n in the denominator) is sqrt(2/3) of
    # the sample std, 18 % lower, and would print 6.16e-04 here.
    values = [120.0, 120.0009, 120.0015]
    expected = pd.Series(values).std()
    assert f"{expected:.2e}" == "7.55e-04" and f"{pd.Series(values).std(ddof=0):.2e}" == "6.16e-04"
    assert summary.cell(values) == f"{pd.Series(values).mean():.2e} ± {expected:.2e} [3]"
    stats = Welford()
    for value in values:
        stats.add(value)
    assert stats.std == pytest.approx(expected, rel=1e-9)
    assert summary.welford_cell(stats) == summary.cell(values)


def test_streaming_cell_of_one_value_and_of_none() -> None:
    stats = Welford()
    assert summary.welford_cell(stats) == ""
    stats.add(0.25)
    assert summary.welford_cell(stats) == "2.50e-01 [1]" and stats.std == 0.0


@given(st.lists(finite, min_size=2, max_size=50))
def test_streaming_std_is_pandas_std(values: list[float]) -> None:
    stats = Welford()
    for value in values:
        stats.add(value)
    assert stats.std == pytest.approx(pd.Series(values).std(), rel=1e-6, abs=1e-12)
    assert Welford.from_list(stats.to_list()) == stats


def test_replace_block_keeps_text_of_others_and_holds_ours_once() -> None:
    ours = [
        summary.TITLE_LINE,
        "",
        "table",
        summary.STARS,
        "",
        summary.ADDITIONS_LINE,
        "Training time: ...",
        summary.STARS,
        "",
        "Resources",
        "x",
        summary.STARS,
    ]
    first = summary.replace_block("user line 1\n", ours)
    assert first.splitlines() == ["user line 1", "", *ours]
    again = summary.replace_block(first + "user line 2\n", [*ours[:2], "new", *ours[3:]])
    lines = again.splitlines()
    assert lines.count(summary.TITLE_LINE) == 1 and "new" in lines and "table" not in lines
    assert lines.count(summary.ADDITIONS_LINE) == 1
    assert lines[0] == "user line 1" and lines[-1] == "user line 2"


def test_replace_takes_the_old_single_block_layout_whole() -> None:
    # Before our additions had a block of their own, they sat inside the reference's block, one
    # star line before Resources; a rerun with the new layout must leave none of it behind.
    old = [
        summary.TITLE_LINE,
        "",
        "Throughput: 1.00 images/s",
        "",
        "Training time: old",
        summary.STARS,
        "",
        "Resources",
        "-" * WIDTH,
        "Records: old",
        summary.STARS,
    ]
    new = [
        summary.TITLE_LINE,
        "new",
        summary.STARS,
        "",
        summary.ADDITIONS_LINE,
        summary.STARS,
        "",
        "Resources",
        summary.STARS,
    ]
    text = summary.replace_block("\n".join(["user text", *old, "after"]) + "\n", new)
    assert text.splitlines() == ["user text", *new, "after"]
