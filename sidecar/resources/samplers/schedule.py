"""A fixed-rate schedule on the monotonic clock that never drifts.

Deadlines are ``start + k × interval``: the next one is computed from the previous
deadline, not from when the work ran, so lateness does not accumulate. Ticks missed
while the caller was busy are skipped (no burst of catch-up samples).
"""

from __future__ import annotations


class Schedule:
    """Deadlines every ``interval_s`` seconds from ``now_ns`` (the first is ``now_ns``)."""

    def __init__(self, interval_s: float, now_ns: int) -> None:
        """Raises ValueError unless ``interval_s`` > 0."""
        if not interval_s > 0:
            raise ValueError(f"interval must be positive, got {interval_s!r}")
        self.interval_ns = round(interval_s * 1e9)
        self.next_due_ns = now_ns

    def due(self, now_ns: int) -> bool:
        """True when the current deadline has been reached."""
        return now_ns >= self.next_due_ns

    def wait_s(self, now_ns: int) -> float:
        """Seconds until the current deadline, 0 if it has passed (for a poll timeout)."""
        return max(0, self.next_due_ns - now_ns) / 1e9

    def advance(self, now_ns: int) -> int:
        """Move to the first deadline after ``now_ns`` on the grid; returns it (ns)."""
        self.next_due_ns += self.interval_ns
        if self.next_due_ns <= now_ns:
            missed = (now_ns - self.next_due_ns) // self.interval_ns + 1
            self.next_due_ns += missed * self.interval_ns
        return self.next_due_ns
