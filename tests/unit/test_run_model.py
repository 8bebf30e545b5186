"""The iteration model on the Run primitives, in-process, as hooks and callbacks drive
them (docs/iteration-model.md): what goes on the wire, read back through a real socket."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from markers import wire
from markers.buffer import FLUSH_RECORDS
from markers.run import Run
from markers.transport import Sender

HELLO = {"type": "hello", "accumulation_steps": 1, "train_batch_size": 1, "val_batch_size": 1}


@pytest.fixture
def wired(tmp_path: Path) -> Iterator[tuple[Run, zmq.Socket]]:
    """A Run whose sender is connected to a ROUTER standing in for the sidecar."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/s.sock"
    router.bind(endpoint)
    sender = Sender(endpoint, os.urandom(16), 0)
    run = Run(sender, dict(HELLO), monitored=True)
    yield run, router
    sender.close()
    router.close(linger=0)


def records(run: Run, router: zmq.Socket) -> list[dict[str, int]]:
    """Everything the run sent so far, decoded (control bodies under ``controls``)."""
    run._buffer.flush()
    out = []
    while router.poll(300):
        _, frame = router.recv_multipart()
        if wire.decode_header(frame).kind == wire.KIND_RECORDS:
            values = wire.decode_records(frame)
            out += [
                dict(zip(wire.RECORD_FIELDS, values[i : i + wire.RECORD_WIDTH], strict=True))
                for i in range(0, len(values), wire.RECORD_WIDTH)
            ]
    return out


def loops(sent: list[dict[str, int]]) -> list[tuple[int, int, int]]:
    """(iteration, flags, batches) of each training loop record."""
    return [
        (r["iteration"], r["flags"], r["batches"]) for r in sent if r["phase"] == wire.TRAINING_LOOP
    ]


def test_an_iteration_begun_again_without_its_end_is_cut_not_merged(wired) -> None:
    run, router = wired
    forward = run.phase("forward")
    run.begin_iteration()
    with forward:
        pass
    run.begin_iteration()  # the hook never ended the first one
    run.batch_done()
    run.end_iteration()
    run.begin_iteration()  # nothing in it: forgotten, its number reused
    run.leave_iteration()
    run.begin_iteration()
    run.batch_done()
    run.end_iteration()
    sent = records(run, router)
    cut = wire.FLAG_IN_ITERATION | wire.FLAG_INCOMPLETE
    assert loops(sent) == [
        (0, cut, 0),
        (1, wire.FLAG_IN_ITERATION, 1),
        (2, wire.FLAG_IN_ITERATION, 1),
    ]
    assert [r["iteration"] for r in sent if r["phase"] == wire.FORWARD] == [0]


def test_a_validation_inside_a_training_iteration_is_taken_off_its_time(wired) -> None:
    run, router = wired
    run.begin_iteration()
    with run.phase("forward"):
        pass
    run.begin_validation()
    run.begin_iteration(validation=True)
    time.sleep(0.02)
    run.batch_done()
    run.end_iteration()
    run.end_validation()
    with run.phase("optimization"):
        pass
    run.batch_done()
    run.end_iteration()
    sent = records(run, router)
    by_phase = {r["phase"]: r for r in sent if not r["flags"] & wire.FLAG_BEGIN}
    validation = by_phase[wire.VALIDATION]
    loop = by_phase[wire.TRAINING_LOOP]
    assert validation["end_ns"] - validation["start_ns"] >= 20_000_000
    assert loop["end_ns"] - loop["start_ns"] < 5_000_000  # the pass is not in it
    optimization = by_phase[wire.OPTIMIZATION]
    assert optimization["flags"] == wire.FLAG_IN_ITERATION  # back in the training one
    assert optimization["iteration"] == loop["iteration"] == 0
    assert loops(sent) == [(0, wire.FLAG_IN_ITERATION, 1)]


def test_a_phase_inside_itself_is_one_record_and_refused_names_warn_once(wired) -> None:
    run, router = wired
    forward = run.phase("forward")
    with forward, forward, forward:
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with run.phase("Training Loop"), run.phase("epoch"):
                pass
    assert len(caught) == 2
    assert run.phase("a\tb") is run.phase("a b")
    sent = records(run, router)
    assert [r["phase"] for r in sent] == [wire.FORWARD]


def test_a_loop_left_by_break_is_whole_by_an_exception_cut(wired) -> None:
    run, router = wired
    run.begin_epoch()
    for _ in run.train_batches([1, 2, 3]):
        with run.phase("forward"):
            pass
        break
    run.end_epoch()
    with pytest.raises(RuntimeError), run.epoch():
        for _ in run.train_batches([1, 2, 3]):
            with run.phase("forward"):
                raise RuntimeError("boom")
    sent = records(run, router)
    cut = wire.FLAG_IN_ITERATION | wire.FLAG_INCOMPLETE
    assert loops(sent) == [(0, wire.FLAG_IN_ITERATION, 1), (1, cut, 1)]
    epochs = [r["flags"] for r in sent if r["phase"] == wire.EPOCH]
    assert epochs == [wire.FLAG_BEGIN, 0, wire.FLAG_BEGIN, wire.FLAG_INCOMPLETE]


def test_phases_in_a_forked_child_are_counted_for_the_parent(wired) -> None:
    run, router = wired
    forward = run.phase("forward")
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker would time phases here
        for _ in range(5):
            with forward:
                pass
        os._exit(0)
    os.waitpid(pid, 0)
    with forward:
        pass
    sent = records(run, router)
    assert [r["phase"] for r in sent] == [wire.FORWARD]  # only the parent's
    assert run._buffer.children.total == 5
    assert run._buffer.hello["worker_phases"] == 5


def test_a_validation_loop_inside_a_training_loop_suspends_its_iteration(wired) -> None:
    run, router = wired
    for step, _ in enumerate(run.train_batches([1, 2])):
        with run.phase("forward"):
            pass
        if step == 1:  # val_batches alone, no run.validation() around it
            for _ in run.val_batches([1, 2]):
                time.sleep(0.05)
        with run.phase("optimization"):
            pass
    sent = records(run, router)
    train = [r for r in sent if r["phase"] == wire.TRAINING_LOOP]
    val = [r for r in sent if r["phase"] == wire.VALIDATION_LOOP]
    val_ns = [r["end_ns"] - r["start_ns"] for r in val]
    assert [d >= 50_000_000 for d in val_ns] == [True, True]
    # an iteration that held the validation would last at least as long as it: one that
    # does not is far shorter, however busy the machine (no fixed bound on its own time)
    assert [r["end_ns"] - r["start_ns"] < sum(val_ns) for r in train] == [True, True]
    optimization = [r for r in sent if r["phase"] == wire.OPTIMIZATION]
    assert [(r["flags"], r["iteration"]) for r in optimization] == [
        (wire.FLAG_IN_ITERATION, 0),
        (wire.FLAG_IN_ITERATION, 1),
    ]


def test_the_send_after_a_validation_pass_stays_out_of_the_training_iteration(
    wired, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass's records are sent when it ends; a slow send (a busy machine) is the
    pass's cost, not the training iteration's."""
    from markers.buffer import RecordBuffer

    run, router = wired
    flush = RecordBuffer.flush

    def slow_flush(buffer: RecordBuffer) -> None:
        time.sleep(0.05)
        flush(buffer)

    run.begin_iteration()
    run.batch_done()
    monkeypatch.setattr(RecordBuffer, "flush", slow_flush)
    run.begin_validation()
    run.end_validation()
    monkeypatch.setattr(RecordBuffer, "flush", flush)
    run.end_iteration()
    (loop,) = [r for r in records(run, router) if r["phase"] == wire.TRAINING_LOOP]
    assert loop["end_ns"] - loop["start_ns"] < 0.03e9  # the sends took >= 0.1 s: excluded


def shape(sent: list[dict[str, int]]) -> list[tuple[int, ...]]:
    """Each record without its times: what it is and where it belongs."""
    keys = ("phase", "flags", "epoch", "iteration", "batch", "batches")
    return [tuple(r[k] for k in keys) for r in sent]


def test_the_drivers_steps_write_what_the_primitives_write(tmp_path: Path) -> None:
    # Enough steps to cross flushes (a context packed with a loop record, or one left for
    # the next message), a validation pass inside a step (a suspended iteration resumes,
    # then the next step goes the fast way again) and accumulation with a short last step.
    steps = 3 * FLUSH_RECORDS // 4

    def script(run: Run, driver: bool) -> None:
        forward = run.phase("forward")
        loader = range(2 * steps + 1)
        with run.epoch():
            if driver:
                for i, _ in enumerate(run.train_batches(loader)):
                    with forward:
                        pass
                    if i == 5:
                        with run.validation():
                            for _ in run.val_batches(range(2)):
                                pass
                return
            for i in loader:
                if i % 2 == 0:
                    run.begin_iteration()
                run.data_loaded(time.perf_counter_ns())
                with forward:
                    pass
                if i == 5:
                    run.begin_validation()
                    for _ in range(2):
                        run.begin_iteration(True)
                        run.data_loaded(time.perf_counter_ns())
                        run.batch_done()
                        run.end_iteration()
                    run.end_validation()
                run.batch_done()
                if i % 2 == 1:
                    run.end_iteration()
            run.end_iteration()

    sent: dict[bool, list[tuple[int, ...]]] = {}
    for driver in (True, False):
        router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        endpoint = f"ipc://{tmp_path}/{driver}.sock"
        router.bind(endpoint)
        sender = Sender(endpoint, os.urandom(16), 0)
        run = Run(sender, {**HELLO, "accumulation_steps": 2}, monitored=True)
        script(run, driver)
        sent[driver] = shape(records(run, router))
        sender.close()
        router.close(linger=0)
    training_loops = [r for r in sent[True] if r[0] == wire.TRAINING_LOOP]
    assert len(training_loops) == steps + 1
    assert training_loops[-1][-1] == 1  # the short last step
    assert sent[True] == sent[False]
