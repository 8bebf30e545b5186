"""The sampling schedule: fixed grid, no drift, missed ticks skipped."""

from __future__ import annotations

import pytest

from sidecar.resources.samplers.schedule import Schedule

S = 1_000_000_000


def test_first_deadline_is_the_start() -> None:
    schedule = Schedule(1.0, 5 * S)
    assert schedule.due(5 * S) and not schedule.due(5 * S - 1)
    assert schedule.wait_s(4 * S) == 1.0 and schedule.wait_s(6 * S) == 0.0


def test_no_drift_over_many_late_ticks() -> None:
    schedule = Schedule(0.1, 0)
    for k in range(10_000):
        now = schedule.next_due_ns + (k * 7_919_000) % 90_000_000  # 0-90 ms late, jittery
        assert schedule.due(now)
        schedule.advance(now)
    assert schedule.next_due_ns == 10_000 * schedule.interval_ns  # lateness did not add up


def test_missed_ticks_are_skipped_without_a_burst() -> None:
    schedule = Schedule(1.0, 0)
    assert schedule.advance(0) == S
    assert schedule.advance(int(5.5 * S)) == 6 * S  # 1..5 missed: next is 6, not 2
    assert not schedule.due(int(5.6 * S))
    assert schedule.advance(6 * S) == 7 * S  # on time: exactly one interval


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Schedule(0.0, 0)
