"""The daemon's lifecycle hooks: what a service manager (sd_notify), an exporter or a test
may plug into the loop without the loop knowing them.

Hooks run on the loop thread and must return quickly; an exception from one is logged and
does not stop the sidecar.
"""

from __future__ import annotations

from typing import Protocol

from sidecar.daemon.snapshot import Snapshot


class Lifecycle(Protocol):
    """Called by ``Server.run``: ``ready`` once the socket is bound and the samplers
    started, ``tick`` with each snapshot the loop publishes (every ``TICK_S`` while the
    loop is healthy, not at every turn), ``stopping`` when the shutdown writing begins,
    ``stopped`` once every file is written and a last ``tick`` handed the final state."""

    def ready(self, snapshot: Snapshot) -> None:
        """The sidecar is bound and sampling."""

    def tick(self, snapshot: Snapshot) -> None:
        """The loop published ``snapshot``, the state of this moment."""

    def stopping(self) -> None:
        """Shutdown has begun: the final files are being written."""

    def stopped(self) -> None:
        """The final files are written and the last ``tick`` held the final state (each
        run's end and status): the sidecar exits after the hooks return."""
