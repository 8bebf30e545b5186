"""The loop's hand-over to the lifecycle hooks survives a snapshot that cannot be taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.daemon.server import Config, Server
from sidecar.daemon.snapshot import Snapshot
from sidecar.resources.samplers.nvml import NvmlUnavailable


class Recorder:
    """A lifecycle hook that keeps what it was given."""

    def __init__(self) -> None:
        self.ticks: list[Snapshot] = []

    def ready(self, snapshot: Snapshot) -> None:
        """Not used here."""

    def tick(self, snapshot: Snapshot) -> None:
        self.ticks.append(snapshot)

    def stopping(self) -> None:
        """Not used here."""


def test_a_failing_snapshot_skips_the_hooks_and_the_loop_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hook = Recorder()
    server = Server(Config(f"ipc://{tmp_path}/s.sock", root=tmp_path), hooks=[hook],
                    open_gpus=lambda visible: NvmlUnavailable("no GPU in this test"))
    try:
        server._publish_for_hooks()
        assert len(hook.ticks) == 1

        def broken() -> Snapshot:
            raise RuntimeError("a view that cannot be built")

        monkeypatch.setattr(server, "publish", broken)
        server._publish_for_hooks()  # logged, not raised
        assert len(hook.ticks) == 1  # no tick (and so no watchdog ping) this turn
    finally:
        server.receiver.close()
        server.monitor.close()
