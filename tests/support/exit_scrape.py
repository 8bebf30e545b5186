"""A lifecycle hook for the tests: at ``stopped`` (the final files written, the final
state handed to the hooks, the sidecar about to exit) it scrapes the sidecar's own
``/metrics`` and keeps the body in a file, so a test reads the last scrape an exporter
could answer without racing the exit."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from sidecar.daemon.snapshot import Snapshot


class ExitScrape:
    """Scrapes ``http://127.0.0.1:PORT/metrics`` at ``stopped`` into ``into``. Placed
    before the exporter among the hooks, its ``stopped`` runs while the exporter serves."""

    def __init__(self, port: int, into: Path) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.into = into

    def ready(self, snapshot: Snapshot) -> None:
        """Nothing: only the end matters here."""

    def tick(self, snapshot: Snapshot) -> None:
        """Nothing: only the end matters here."""

    def stopping(self) -> None:
        """Nothing: the files are still being written."""

    def stopped(self) -> None:
        """Scrape now and keep the body (a failure is logged by the server's hook call)."""
        with urllib.request.urlopen(self.url, timeout=10) as response:
            self.into.write_bytes(response.read())
