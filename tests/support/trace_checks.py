"""Checks of a Chrome Trace Event document's slices that every viewer relies on."""

from __future__ import annotations

from typing import Any


def assert_drawable(events: list[dict[str, Any]]) -> int:
    """Assert the ``X`` slices of ``events`` are whole microseconds and nest per track
    (``pid``, ``tid``): no slice ends after its successor starts unless it holds it, and a
    slice never ends at the very microsecond an equal-named one starts (speedscope would
    open that one inside it). Returns the number of slices checked."""
    slices = sorted(
        (e for e in events if e["ph"] == "X"),
        key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]),
    )
    open_slices: list[dict[str, Any]] = []
    track = None
    for event in slices:
        assert isinstance(event["ts"], int) and isinstance(event["dur"], int), event
        assert event["dur"] >= 0 and "args" not in event, event
        if (event["pid"], event["tid"]) != track:
            track, open_slices = (event["pid"], event["tid"]), []
        end = event["ts"] + event["dur"]
        while open_slices and open_slices[-1]["ts"] + open_slices[-1]["dur"] <= event["ts"]:
            done = open_slices.pop()
            if done["name"] == event["name"] and done["dur"] > 0:
                assert done["ts"] + done["dur"] < event["ts"], (done, event)
        if open_slices:
            outer = open_slices[-1]
            assert end <= outer["ts"] + outer["dur"], (event, "passes", outer)
        open_slices.append(event)
    return len(slices)
