"""The server's loop: its hand-over to the lifecycle hooks survives a snapshot that cannot be
taken, and shows a run's end before its final files are written; one read of its socket is
bounded in bytes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO

import pytest
import zmq

from markers import wire
from sidecar.daemon.metrics import MetricsExporter
from sidecar.daemon.server import Config, Server
from sidecar.daemon.snapshot import Snapshot
from sidecar.ingest.receiver import READ_BYTES
from sidecar.resources.samplers.nvml import NvmlUnavailable
from tests.support.frames import Client


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

    def stopped(self) -> None:
        """Not used here."""


def test_a_failing_snapshot_skips_the_hooks_and_the_loop_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = Recorder()
    server = Server(
        Config(f"ipc://{tmp_path}/s.sock", root=tmp_path),
        hooks=[hook],
        open_gpus=lambda visible: NvmlUnavailable("no GPU in this test"),
    )
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


def _run_gauges(exporter: MetricsExporter) -> dict[str, float]:
    """The run-state samples a scrape of ``exporter`` would give now, by metric name (and
    status for ``trainmon_run_status``)."""
    gauges: dict[str, float] = {}
    for family in exporter.registry.collect():
        for sample in family.samples:
            if sample.name == "trainmon_run_status":
                gauges[f"status={sample.labels['status']}"] = sample.value
            elif sample.name in ("trainmon_run_running", "trainmon_run_end_timestamp_seconds"):
                gauges[sample.name] = sample.value
    return gauges


def test_the_metrics_say_a_run_ended_before_its_final_files_are_written(tmp_path: Path) -> None:
    """What a scrape would give while each file of the run's final write is being written
    (the write seam runs inside the write): already the run's end, never "running"."""
    exporter = MetricsExporter(0, "127.0.0.1")  # its registry is what /metrics serves
    seen: list[tuple[str, dict[str, float]]] = []

    def write_bytes(handle: BinaryIO, path: Path, data: bytes) -> None:
        seen.append((path.name, _run_gauges(exporter)))
        handle.write(data)

    endpoint = f"ipc://{tmp_path}/s.sock"
    server = Server(
        Config(endpoint, root=tmp_path),
        hooks=[exporter],
        open_gpus=lambda visible: NvmlUnavailable("no GPU in this test"),
        write_bytes=write_bytes,
    )
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        client = Client()
        dealer.send(client.hello(str(tmp_path / "job")))
        dealer.send(client.records(10))
        deadline = time.monotonic() + 30
        while not server.registry.streams and time.monotonic() < deadline:
            server.turn()
        server._publish_for_hooks()  # a tick while it runs, as the loop's own
        assert _run_gauges(exporter)["trainmon_run_running"] == 1.0
        dealer.send(client.control({"type": wire.FINISH, "status": "completed"}))
        while not any("run.json" in name for name, _ in seen) and time.monotonic() < deadline:
            server.turn()
    finally:
        dealer.close(linger=0)
        server.receiver.close()
        server.monitor.close()
    assert any("run.json" in name for name, _ in seen), seen
    for name, gauges in seen:
        assert gauges["trainmon_run_running"] == 0.0, name
        assert gauges["status=completed"] == 1.0, name
        assert gauges["trainmon_run_end_timestamp_seconds"] > 0, name


def test_one_read_is_bounded_in_bytes_and_nothing_waiting_is_lost(tmp_path: Path) -> None:
    """Full flushes of 1023 records: one read stops near READ_BYTES (the bytes decoded at
    once bound the sidecar's memory); the reads after it take the rest, in order."""
    endpoint = f"ipc://{tmp_path}/s.sock"
    server = Server(
        Config(endpoint, root=tmp_path),
        open_gpus=lambda visible: NvmlUnavailable("no GPU in this test"),
    )
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        client = Client()
        frame = client.records(wire.FLUSH_SLOTS - 1)
        count = 3 * READ_BYTES // len(frame)
        for _ in range(count):
            dealer.send(frame)
            frame = client.records(wire.FLUSH_SLOTS - 1)
        time.sleep(0.5)  # every one of them waits in the sidecar's receive queue
        reads: list[list[int]] = []
        deadline = time.monotonic() + 10
        while sum(map(len, reads)) < count and time.monotonic() < deadline:
            if messages := server.receiver.read(100):
                reads.append([m.header.seq for m in messages])
        assert [seq for read in reads for seq in read] == list(range(count))
        largest = max(map(len, reads))
        assert largest * (len(frame) - wire.SLOT_BYTES) <= READ_BYTES + len(frame)
    finally:
        dealer.close(linger=0)
        server.receiver.close()
        server.monitor.close()
