"""A split continued from a saved state, and the lineage that decides which state may
continue it.

Every rank of a split this sidecar writes is claimed (one writer per split and rank,
across sidecars: ``sidecar.sinks.locks``); the rank's lock file records the last run
started on it and its lineage (the run whose first session the rank's state goes back to). A
resume takes only a state of the lineage of the last run started on the split
(``state.lineage``): a state older than a run started afresh since is refused.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from markers import wire
from sidecar.ingest.stream import HOSTNAME, Stream
from sidecar.model import state
from sidecar.model.aggregator import RankAggregator
from sidecar.model.split import Split, split_dir

log = logging.getLogger("sidecar")

SplitKey = tuple[Path, int]  # (run folder, split index)


class Claim(Protocol):
    """This sidecar's exclusive claim on a rank of a split (``sidecar.sinks.locks``)."""

    previous: dict[str, Any]  # what the last holder recorded

    def record(self, holder: dict[str, Any]) -> None:
        """Say who holds it now."""

    def release(self) -> None:
        """Give it up."""


def _iso(unix: Any) -> str:
    if not isinstance(unix, (int, float)):
        return "an unknown time"
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="seconds")


class Lineage:
    """The claims of this sidecar on ranks of splits and, per split, what their lock files
    say of the last run started on each rank: ``{"ranks": {rank: {"run_id", "lineage",
    "start_unix", "pid", "host"}}, "sidecar_pid", "host"}``. ``claim(split_dir, rank)``
    takes a rank (raises Refused when another live sidecar holds it; None when it cannot
    be used now_unix, the writes will say why)."""

    def __init__(self, claim: Callable[[Path, int], Claim | None]) -> None:
        self.claim = claim
        self.claims: dict[tuple[SplitKey, int], Claim] = {}
        self.last_runs: dict[SplitKey, dict[str, Any]] = {}

    def take(self, key: SplitKey, rank: int) -> None:
        """Claim ``rank`` of the split unless this sidecar holds it already."""
        if (key, rank) not in self.claims:
            claim = self.claim(split_dir(*key), rank)
            if claim is not None:
                self.claims[(key, rank)] = claim
                said = claim.previous.get("ranks")
                previous = said.get(str(rank)) if isinstance(said, dict) else None
                last = self.last_runs.setdefault(key, {}).setdefault("ranks", {})
                if isinstance(previous, dict):
                    last[str(rank)] = previous

    def check(self, key: SplitKey, saved: dict[str, Any], rank: int) -> None:
        """Raise StateError when ``saved`` is not of the lineage of the last run started
        on the split's ``rank`` (a run started afresh after it left no state of its own)."""
        ranks = self.last_runs.get(key, {}).get("ranks")
        last = ranks.get(str(rank)) if isinstance(ranks, dict) else None
        lineage = state.lineage(saved, rank)
        if (
            not isinstance(last, dict)
            or not lineage
            or not last.get("lineage")
            or last["lineage"] == lineage
        ):
            return
        raise state.StateError(
            f"the saved state belongs to run {lineage[:8]}, but run {str(last.get('run_id'))[:8]} "
            f"started afresh in this folder after it (at {_iso(last.get('start_unix'))}) and "
            "left no state: that state is older than the last run and is not loaded"
        )

    def record(self, stream: Stream, agg: RankAggregator) -> None:
        """Note ``stream`` as the last run started on its split and rank, in memory and in
        the split's lock file; its lineage is its aggregator's first session's run."""
        key = (stream.split.out_dir, stream.split.split)
        last = self.last_runs.setdefault(key, {})
        known = last.get("ranks")
        ranks: dict[str, Any] = known if isinstance(known, dict) else {}
        ranks[str(stream.rank)] = {
            "run_id": stream.key,
            "lineage": agg.sessions[0].run_id or stream.key,
            "start_unix": stream.start_unix,
            "pid": stream.pid,
            "host": stream.host,
        }
        last.update({"sidecar_pid": os.getpid(), "host": HOSTNAME, "ranks": ranks})
        claim = self.claims.get((key, stream.rank))
        if claim is not None:
            claim.record({**last, "ranks": {str(stream.rank): ranks[str(stream.rank)]}})

    def release(self, split: Split) -> None:
        """Give up the claims on ``split``'s ranks (none of its runs is live)."""
        key = (split.out_dir, split.split)
        for taken in [k for k in self.claims if k[0] == key]:
            self.claims.pop(taken).release()


def restore(stream: Stream, saved: dict[str, Any], now_unix: float, repeat: bool) -> RankAggregator:
    """Continue ``stream``'s rank from the state document ``saved``; returns its
    aggregator with the process's session open. Raises StateError (with the reason)
    for a state of another schema that cannot be upgraded or that does not fit it.
    """
    split = stream.split
    saved = state.upgrade(saved)
    continuing = stream.key if repeat else ""
    try:
        agg = split.load_state(saved, stream.rank, continuing)
        saved_unix = float(
            saved["ranks"].get(str(stream.rank), {}).get("saved_unix", stream.start_unix)
        )
        if not (agg.sessions and agg.sessions[-1].end_ns is None):
            # the loaded sessions are used here first: a wrong value in them fails here
            agg.account_resume(saved_unix, stream.previous_end_unix, stream.start_unix)
            agg.begin_session(stream.start_unix, stream.start_ns, stream.key)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError, ArithmeticError) as exc:
        split.fresh_rank(stream.rank)
        raise state.StateError(
            f"saved state does not fit schema {state.SCHEMA} ({type(exc).__name__}: {exc})"
        ) from None
    if repeat:  # a new sidecar took over a running process: what came since is missing
        split.gaps.append((max(saved_unix, stream.start_unix), now_unix))
        stream.received = split.received.get(stream.key, 0)
    return agg


def _saved_unix(saved: dict[str, Any], rank: int) -> float:
    mine = saved.get("ranks", {}).get(str(rank)) if isinstance(saved.get("ranks"), dict) else None
    value = mine.get("saved_unix") if isinstance(mine, dict) else None
    return float(value) if isinstance(value, (int, float)) else float("-inf")


def rank_state(split_dir: Path, rank: int) -> dict[str, Any]:
    """The newest saved state of ``rank`` in a split's folder: the state file of the
    sidecar that served rank 0, or one of the other nodes' (``state/<node-id>.json``,
    docs/multi-node.md), whichever saved the rank last. Raises StateError (the state
    file's) when none holds it."""
    candidates = [
        state.state_path(split_dir),
        *sorted((split_dir / state.STATE_DIR).glob("*.json")),
    ]
    found: list[dict[str, Any]] = []
    error: state.StateError | None = None
    for path in candidates:
        try:
            found.append(state.load(path))
        except state.StateError as exc:
            error = error or exc
    holding = [saved for saved in found if _saved_unix(saved, rank) > float("-inf")]
    if holding:
        return max(holding, key=lambda saved: _saved_unix(saved, rank))
    if found:
        return found[0]
    assert error is not None  # there is always the standard file's path
    raise error


def resume_from_folder(
    stream: Stream, lineage: Lineage, now_unix: float, repeat: bool
) -> tuple[RankAggregator | None, str | None]:
    """Continue ``stream``'s rank from the state saved in its split's folder
    (``rank_state``): (its aggregator, None), or (None, the warning) when there is no
    state that may continue it (the split then starts afresh)."""
    split = stream.split
    try:
        saved = rank_state(split.split_dir, stream.rank)
        lineage.check((split.out_dir, split.split), saved, stream.rank)
        return restore(stream, saved, now_unix, repeat), None
    except state.StateError as exc:
        return None, f"{exc}; starting this split afresh"


def load_state(stream: Stream, saved: Any, lineage: Lineage) -> dict[str, Any]:
    """A ``load_state`` control: continue ``stream``'s split from a state the user kept
    (``run.state_dict()`` of an earlier process). The reply carries the epoch to go on
    from, or ``ok: False`` and the reason.
    """
    try:
        agg = restore(stream, saved, 0.0, repeat=False)
    except state.StateError as exc:
        agg = stream.split.rank(stream.rank)
        if not agg.sessions or agg.sessions[-1].end_ns is not None:  # reset by the failure
            agg.begin_session(stream.start_unix, stream.start_ns, stream.key)
        log.warning("run %s: state not loaded: %s", stream.key, exc)
        return {"ok": False, "error": str(exc)}
    lineage.record(stream, agg)  # the user's state: this run continues its lineage
    stream.split.dirty = True
    return {"ok": True, "session": agg.sessions[-1].number, "epoch": next_epoch(agg)}


def state_of(stream: Stream) -> dict[str, Any]:
    """A ``state`` control: the state document of ``stream``'s split (for the user's own
    checkpoint); the same content as the state file of a checkpoint.
    """
    return {"ok": True, "state": state.document(stream.split.to_state())}


def next_epoch(agg: RankAggregator) -> int:
    """The epoch a process continuing ``agg`` goes on from: the one open at the
    checkpoint (its second part), else the one after the last stored (0 when none)."""
    open_epochs = [epoch for phase, epoch in agg.continued if phase == wire.EPOCH]
    if open_epochs:
        return open_epochs[0]
    epochs = agg.series.get(wire.EPOCH)
    return max((r.epoch for r in epochs.rows), default=-1) + 1 if epochs else 0
