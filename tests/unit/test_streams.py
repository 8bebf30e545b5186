"""The registry's bookkeeping for a long-lived daemon: ended splits are forgotten."""

from __future__ import annotations

from pathlib import Path

import pytest

from markers import wire
from sidecar.ingest.pending import PENDING_RECORDS, PENDING_S
from sidecar.ingest.streams import Registry
from tests.support.frames import Client


def test_ended_and_written_splits_are_forgotten_after_a_while(tmp_path: Path) -> None:
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    frame = Client().hello("job")
    header, body = wire.decode_header(frame), wire.decode_control(frame)
    registry.hello(header, body, now_unix=100.0)
    (stream,) = registry.streams.values()
    split = stream.split
    registry.finish(stream, "completed", None, None, now_unix=200.0)
    assert registry.prune(now_unix=700.0, keep_s=600.0) == []  # dirty: not written yet
    split.dirty = False
    assert registry.prune(now_unix=700.0, keep_s=600.0) == []  # ended only 500 s ago
    assert registry.prune(now_unix=801.0, keep_s=600.0) == [split]
    assert registry.splits == {} and registry.streams == {}


def _hello(
    registry: Registry, client: Client, out_dir: str, now_unix: float = 100.0, **extra: object
) -> dict[str, object]:
    frame = client.hello(out_dir, **extra)
    return registry.hello(wire.decode_header(frame), wire.decode_control(frame), now_unix)


def test_a_hello_opens_a_split_and_a_repeated_hello_keeps_it(tmp_path: Path) -> None:
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    client = Client()
    reply = _hello(registry, client, "job")
    assert reply["ok"] and reply["session"] == 0 and reply["epoch"] == 0
    assert reply["out_dir"] == str(tmp_path / "job")
    again = _hello(registry, client, "job")
    assert again == {"ok": True, "session": 0}
    assert len(registry.splits) == 1 and len(registry.streams) == 1


def test_resume_without_a_state_file_starts_afresh_with_a_warning(tmp_path: Path) -> None:
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    reply = _hello(registry, Client(), "job", resume=True)
    assert reply["ok"] and "starting this split afresh" in str(reply["warning"])


def test_a_repeated_hello_of_an_unknown_run_is_a_takeover_with_a_gap(tmp_path: Path) -> None:
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    _hello(registry, Client(), "job", now_unix=150.0, repeat=True, start_unix=100.0)
    (split,) = registry.splits.values()
    assert split.gaps == [(100.0, 150.0)]


def test_a_hello_with_a_malformed_pid_changes_nothing(tmp_path: Path) -> None:
    """Every field of a hello is checked before a split is opened for it: a bad one
    leaves no half-registered split behind (it would show as running, and block the
    next hello of its folder)."""
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    with pytest.raises(wire.WireError, match="'pid'"):
        _hello(registry, Client(), "job", pid=-1)
    assert registry.splits == {} and registry.streams == {}


def test_malformed_hellos_and_phase_declarations_are_refused(tmp_path: Path) -> None:
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    client = Client()
    with pytest.raises(wire.WireError):
        _hello(registry, client, "job", warmup_iterations=-1)
    _hello(registry, Client(b"r" * 16), "job")
    (stream,) = registry.streams.values()
    with pytest.raises(wire.WireError):
        registry.declare_phase(stream, {"id": 3, "name": "low id"})
    with pytest.raises(wire.WireError):
        registry.declare_phase(stream, {"id": wire.FIRST_CUSTOM_ID, "name": ""})
    for reserved in ("Forward", "TRAINING LOOP", "epoch", "forward gpu"):
        with pytest.raises(wire.WireError):  # it would shadow a standard column
            registry.declare_phase(stream, {"id": wire.FIRST_CUSTOM_ID, "name": reserved})
    registry.declare_phase(stream, {"id": wire.FIRST_CUSTOM_ID, "name": "aug\tment"})
    assert stream.custom_names == {wire.FIRST_CUSTOM_ID: "aug ment"}
    with pytest.raises(wire.WireError):  # one id, one name
        registry.declare_phase(stream, {"id": wire.FIRST_CUSTOM_ID, "name": "other"})


def test_records_before_the_hello_wait_then_count(tmp_path: Path) -> None:
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    client = Client()
    records_frame = client.records(5)
    hello_frame = client.hello("job")
    registry.records(
        wire.decode_header(records_frame), wire.decode_records(records_frame), now_unix=10.0
    )
    assert registry.records_received == 0
    registry.hello(wire.decode_header(hello_frame), wire.decode_control(hello_frame), 11.0)
    assert registry.records_received == 5


def test_records_held_for_a_hello_are_bounded_in_records(tmp_path: Path) -> None:
    """A flood of records for runs that never say hello: held up to PENDING_RECORDS in
    all (a few large messages as many small ones), the rest rejected and counted."""
    registry = Registry(lambda out_dir, cwd, owner: tmp_path / out_dir)
    per_message = 40_000
    sent = 0
    for _ in range(8):
        frame = Client().records(per_message)
        registry.records(wire.decode_header(frame), wire.decode_records(frame), now_unix=10.0)
        sent += per_message
    held = PENDING_RECORDS // per_message * per_message
    assert registry.rejected["unknown_run"] == sent - held
    registry.expire_pending(now_unix=10.0 + PENDING_S)
    assert registry.rejected["unknown_run"] == sent
    frame = Client().records(PENDING_RECORDS)  # room again once they expired
    registry.records(wire.decode_header(frame), wire.decode_records(frame), now_unix=20.0)
    assert registry.rejected["unknown_run"] == sent
