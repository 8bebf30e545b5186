"""``compare.gate``'s rule: a change fails when it is beyond the allowed percentage and
its interval excludes no change; either alone passes."""

from __future__ import annotations

import pytest

from sidecar.report.compare import ComparedFigure, gate


def _result(change_pct: float, ci: tuple[float, float], rate: bool = False) -> dict:
    figure = ComparedFigure(
        "throughput" if rate else "Training loop",
        "samples/s" if rate else "s",
        1.0,
        1.0 + change_pct / 100,
        (1.0, 1.0),
        (1.0, 1.0),
        change_pct,
        ci,
        (100, 100),
    )
    return {
        "phases": [] if rate else [figure],
        "figures": [figure] if rate else [],
        "unlike": [],
    }


@pytest.mark.parametrize(
    ("change_pct", "ci", "passed"),
    [
        (8.0, (1.0, 15.0), False),  # beyond 5 % and real: fails
        (8.0, (-1.0, 17.0), True),  # beyond, but no change is within its interval
        (3.0, (2.0, 4.0), True),  # real, but within the 5 % allowed
        (5.0, (4.0, 6.0), True),  # at the limit, not beyond it
        (-9.0, (-12.0, -6.0), True),  # faster
    ],
)
def test_step_time_fails_only_when_beyond_the_limit_and_real(
    change_pct: float, ci: tuple[float, float], passed: bool
) -> None:
    verdict, line = gate(_result(change_pct, ci), 5)
    assert verdict is passed and line.startswith("PASS" if passed else "FAIL: step time"), line


@pytest.mark.parametrize(
    ("change_pct", "ci", "passed"),
    [(-8.0, (-15.0, -1.0), False), (-8.0, (-17.0, 1.0), True), (-3.0, (-4.0, -2.0), True)],
)
def test_throughput_fails_only_when_lower_beyond_the_limit_and_real(
    change_pct: float, ci: tuple[float, float], passed: bool
) -> None:
    verdict, line = gate(_result(change_pct, ci, rate=True), 5)
    assert verdict is passed and line.startswith("PASS" if passed else "FAIL: throughput"), line
