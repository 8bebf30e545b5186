"""A progress bar on stderr while the report reads folders, drawn only on a terminal (a
log file or a pipe gets nothing)."""

from __future__ import annotations

import sys
from typing import TextIO

WIDTH = 40


class Progress:
    """``update(done, total)`` redraws the bar when the shown percentage changes."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.enabled = self.stream.isatty()
        self._shown = -1

    def update(self, done: int, total: int) -> None:
        """Show ``done`` of ``total``; a newline once all are done."""
        if not self.enabled or total <= 0:
            return
        percent = done * 100 // total
        if percent == self._shown and done < total:
            return
        self._shown = percent
        filled = WIDTH * done // total
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{total}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
