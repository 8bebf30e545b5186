"""The statistics and the placement of our blocks in summary.log, on hand-made values:
the sample standard deviation (pandas' ``Series.std()``) in the stored and the streaming
cells, and the replacement of our blocks, old layout included, keeping others' text."""

from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.model.stats import Welford
from sidecar.sinks.summary import (
    ADDITIONS_LINE,
    STARS,
    TITLE_LINE,
    cell,
    replace_block,
    welford_cell,
)

finite = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False)


def test_cells_use_the_sample_std() -> None:
    # Three epochs: at n = 3 the population std (n in the denominator) is sqrt(2/3) of
    # the sample std, 18 % lower, and would print 6.16e-04 here.
    values = [120.0, 120.0009, 120.0015]
    expected = pd.Series(values).std()
    assert f"{expected:.2e}" == "7.55e-04" and f"{pd.Series(values).std(ddof=0):.2e}" == "6.16e-04"
    assert cell(values) == f"{pd.Series(values).mean():.2e} ± {expected:.2e} [3]"
    stats = Welford()
    for value in values:
        stats.add(value)
    assert stats.std == pytest.approx(expected, rel=1e-9)
    assert welford_cell(stats) == cell(values)


def test_one_value_and_none() -> None:
    assert cell([0.25]) == "2.50e-01 [1]" and cell([]) == ""
    stats = Welford()
    assert welford_cell(stats) == ""
    stats.add(0.25)
    assert welford_cell(stats) == "2.50e-01 [1]" and stats.std == 0.0


@given(st.lists(finite, min_size=2, max_size=50))
def test_streaming_std_is_pandas_std(values: list[float]) -> None:
    stats = Welford()
    for value in values:
        stats.add(value)
    expected = pd.Series(values).std()
    assert stats.std == pytest.approx(expected, rel=1e-6, abs=1e-12)
    restored = Welford.from_list(stats.to_list())
    assert restored == stats


def block(marker: str) -> list[str]:
    """Our three blocks as computational_block lays them out, tagged by ``marker``."""
    return [TITLE_LINE, marker, STARS, "", ADDITIONS_LINE, "Training time: ...", STARS, "",
            "Resources", "-" * 106, "Records: ...", STARS]


def test_replace_keeps_others_text_around_our_blocks() -> None:
    first = replace_block("Accuracy 0.93\n", block("first"))
    assert first.splitlines() == ["Accuracy 0.93", "", *block("first")]
    second = replace_block(first + "Trailer\n", block("second"))
    assert second.splitlines() == ["Accuracy 0.93", "", *block("second"), "Trailer"]


def test_replace_takes_the_old_single_block_layout_whole() -> None:
    # Before issue 13 our additions sat inside the reference's block, one star line
    # before Resources; a rerun with the new layout must leave none of it behind.
    old = [TITLE_LINE, "", "Throughput: 1.00 images/s", "", "Training time: old", STARS, "",
           "Resources", "-" * 106, "Records: old", STARS]
    text = replace_block("\n".join(["user text", *old, "after"]) + "\n", block("new"))
    assert text.splitlines() == ["user text", *block("new"), "after"]
