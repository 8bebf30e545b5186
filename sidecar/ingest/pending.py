"""Records of a run whose hello has not come yet (a restarted sidecar hears a running
process's records before its periodic hello): held a while, bounded in records, then
replayed once the hello comes or counted as rejected."""

from __future__ import annotations

import numpy as np

from markers import wire

# Records of a run we have not heard the hello of yet wait this long for the markers'
# periodic hello, at most this many records in all (~18 MB: bounded in bytes, whatever
# the size of the messages).
PENDING_S = 5.0
PENDING_RECORDS = 200_000

Held = tuple[float, wire.Header, np.ndarray]  # (arrival, Unix s; header; records)


class Pending:
    """The held records, per run id, in the order they came."""

    def __init__(self) -> None:
        self._held: dict[bytes, list[Held]] = {}
        self.records = 0  # held now, all runs together

    def hold(self, header: wire.Header, values: np.ndarray, now_unix: float) -> bool:
        """Keep ``values`` (records × RECORD_WIDTH) for ``header``'s run; False (nothing
        kept) when that would hold more than ``PENDING_RECORDS``."""
        if self.records + len(values) > PENDING_RECORDS:
            return False
        # a copy: a view would keep the whole read's decoded records alive
        self._held.setdefault(header.run_id, []).append((now_unix, header, values.copy()))
        self.records += len(values)
        return True

    def take(self, run_id: bytes) -> list[Held]:
        """The records held for ``run_id`` (its hello came), no longer held."""
        held = self._held.pop(run_id, [])
        self.records -= sum(len(values) for _, _, values in held)
        return held

    def expire(self, now_unix: float) -> dict[bytes, int]:
        """Drop the records held ``PENDING_S`` or longer; returns how many per run id."""
        expired_by_run: dict[bytes, int] = {}
        for run_id, held in list(self._held.items()):
            keep = [h for h in held if now_unix - h[0] < PENDING_S]
            expired = sum(
                len(values) for arrived, _, values in held if now_unix - arrived >= PENDING_S
            )
            if expired:
                expired_by_run[run_id] = expired
            self.records -= expired
            if keep:
                self._held[run_id] = keep
            else:
                del self._held[run_id]
        return expired_by_run
