"""systemd's end of the sd_notify protocol for tests: a bound datagram socket."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path


class Manager:
    """systemd's end of the protocol: a bound datagram socket; keeps (monotonic s, text)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.got: list[tuple[float, str]] = []

    def collect(self, seconds: float) -> None:
        """Receive for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                self.got.append((time.monotonic(), self.sock.recv(4096).decode()))

    def until(self, word: str, timeout_s: float) -> float:
        """Receive until a message holding ``word`` came; returns when it came."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for when, text in self.got:
                if word in text.split("\n"):
                    return when
            self.collect(0.1)
        raise AssertionError(f"no {word} within {timeout_s} s; got {self.got}")

    def count(self, word: str, since: float = 0.0) -> int:
        """Messages holding ``word`` received after ``since``."""
        return sum(1 for when, text in self.got if when >= since and word in text.split("\n"))
