"""The registry's bookkeeping for a long-lived daemon: ended splits are forgotten."""

from __future__ import annotations

from pathlib import Path

from markers import wire
from sidecar.ingest.streams import Registry
from tests.support.frames import Client


def test_ended_and_written_splits_are_forgotten_after_a_while(tmp_path: Path) -> None:
    registry = Registry(lambda out_dir, cwd: tmp_path / out_dir)
    frame = Client().hello("job")
    header, body = wire.decode_header(frame), wire.decode_control(frame)
    registry.hello(header, body, now=100.0)
    (stream,) = registry.streams.values()
    split = stream.split
    registry.finish(stream, "completed", None, None, now=200.0)
    assert registry.prune(now=700.0, keep_s=600.0) == []  # dirty: not written yet
    split.dirty = False
    assert registry.prune(now=700.0, keep_s=600.0) == []  # ended only 500 s ago
    assert registry.prune(now=801.0, keep_s=600.0) == [split]
    assert registry.splits == {} and registry.streams == {}
