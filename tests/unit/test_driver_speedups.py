"""The compiled loop driver's step (markers/_driver.c) writes exactly the records the
pure-Python one (``markers.driver.PureStep``) writes: normal loops with and without
accumulation, ``break``, an exception from the loader, an exception in the body, an
empty loader, a validation loop inside a training step, explicit ``close()``, loops long
enough to flush mid-step and to reach the GPU check. Each scenario runs on a real Run
with a real socket standing in for the sidecar, once per driver; the records read back
must be the same (kinds, fields, order), some are also spelled out (the same wrong answer
twice would not pass), and every timestamp must lie inside the scenario, in order."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import markers.run as run_module
from markers import driver, wire
from markers.buffer import FLUSH_RECORDS
from markers.run import Run
from markers.transport import Sender

COMPILED = driver.accelerated_driver()
DRIVERS = [driver.PureDriver, COMPILED]
IN_ITERATION = wire.FLAG_IN_ITERATION
CUT = wire.FLAG_IN_ITERATION | wire.FLAG_INCOMPLETE
TIMES = ("start_ns", "end_ns")

Scenario = Callable[[Run], None]


def wired_run(tmp_path: Path, name: str, accumulation: int) -> tuple[Run, Sender, zmq.Socket]:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/{name}.sock"
    router.bind(endpoint)
    sender = Sender(endpoint, os.urandom(16), 0)
    hello = {
        "type": "hello",
        "accumulation_steps": accumulation,
        "train_batch_size": 2,
        "val_batch_size": 2,
    }
    return Run(sender, hello, monitored=True), sender, router


def sent(run: Run, router: zmq.Socket) -> list[dict[str, Any]]:
    """Every record the run sent, decoded, and its batch size controls, in order."""
    run._buffer.flush()
    out: list[dict[str, Any]] = []
    while router.poll(300):
        _, frame = router.recv_multipart()
        if wire.decode_header(frame).kind == wire.KIND_CONTROL:
            control = wire.decode_control(frame)
            if control["type"] == wire.BATCH_SIZE:
                out.append(control)
        elif wire.decode_header(frame).kind == wire.KIND_RECORDS:
            values = wire.decode_records(frame)
            out += [
                dict(zip(wire.RECORD_FIELDS, values[i : i + wire.RECORD_WIDTH], strict=True))
                for i in range(0, len(values), wire.RECORD_WIDTH)
            ]
    return out


def play(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: Any,
    scenario: Scenario,
    accumulation: int,
) -> list[dict[str, int]]:
    """``scenario`` on a fresh Run driven by ``kind``: its records, timestamps checked
    against the scenario's own clock and then left out."""
    monkeypatch.setattr(run_module, "Driver", kind)
    run, sender, router = wired_run(tmp_path, kind.__name__ + str(id(scenario)), accumulation)
    assert type(run.train_batches([])) is kind
    try:
        before_ns = time.perf_counter_ns()
        scenario(run)
        after_ns = time.perf_counter_ns()
        records = sent(run, router)
    finally:
        sender.close()
        router.close(linger=0)
    for record in records:
        if "start_ns" in record:
            assert before_ns <= record["start_ns"] <= record["end_ns"] <= after_ns, record
    loading = [r["start_ns"] for r in records if r.get("phase") == wire.TRAINING_DATA_LOADING]
    assert loading == sorted(loading)
    return [{k: v for k, v in r.items() if k not in TIMES} for r in records]


def batches(n: int) -> list[tuple[int, int]]:
    return [(i, i) for i in range(n)]


class Shape:
    """A batch with a shape, as a tensor has (the batch size reader's fast path)."""

    def __init__(self, size: int) -> None:
        self.shape = (size, 3)


def body(run: Run) -> None:
    with run.phase("forward"):
        pass


def normal(run: Run) -> None:
    with run.epoch():
        for _ in run.train_batches(batches(5)):
            body(run)


def shaped(run: Run) -> None:
    # Sizes read directly (the C step's own case) and changing: 2, 2, 1, 3, then a batch
    # the direct read cannot tell (fields disagree) and one of size 0.
    loader = [
        Shape(2),
        (Shape(2), Shape(2)),
        {"x": Shape(1), "y": Shape(1)},
        [Shape(3)],
        (Shape(3), Shape(4)),
        Shape(0),
        Shape(3),
    ]
    with run.epoch():
        for _ in run.train_batches(loader):
            body(run)
    with run.epoch():
        for _ in run.train_batches([Shape(3), Shape(3)]):  # a new loop, the same size
            body(run)


def broken(run: Run) -> None:
    with run.epoch():
        for i, _ in enumerate(run.train_batches(batches(6))):
            body(run)
            if i == 2:
                break
        for _ in run.train_batches(batches(2)):  # the numbering goes on after a break
            body(run)


def loader_raises(run: Run) -> None:
    def loader() -> Iterator[tuple[int, int]]:
        yield (0, 0)
        yield (1, 1)
        yield (2, 2)
        raise OSError("a worker died")

    with pytest.raises(OSError), run.epoch():
        for _ in run.train_batches(loader()):
            body(run)


def body_raises(run: Run) -> None:
    with pytest.raises(KeyError), run.epoch():
        for i, _ in enumerate(run.train_batches(batches(6))):
            body(run)
            if i == 2:
                raise KeyError("body")


def left_before_use(run: Run) -> None:
    with run.epoch():
        for i, _ in enumerate(run.train_batches(batches(6))):
            if i == 1:
                break  # the second batch never went through the network
            body(run)


def empty(run: Run) -> None:
    with run.epoch():
        for _ in run.train_batches([]):
            body(run)
    unused = run.train_batches(batches(3))  # never iterated: nothing happens
    del unused


def closed(run: Run) -> None:
    with run.epoch():
        loop = run.train_batches(batches(4))
        next(loop)
        body(run)
        loop.close()  # type: ignore[attr-defined]
        assert next(loop, None) is None


def validation_inside(run: Run) -> None:
    with run.epoch():
        for i, _ in enumerate(run.train_batches(batches(3))):
            body(run)
            if i == 1:
                with run.validation():
                    for _ in run.val_batches(batches(2)):
                        with run.phase("evaluation"):
                            pass


def long_loop(run: Run) -> None:
    # Past a flush (n + 6 > flush_at mid-step) and past the GPU check (every 100).
    with run.epoch():
        for _ in run.train_batches(batches(FLUSH_RECORDS // 2 + 150)):
            body(run)


SCENARIOS = {
    "normal": (normal, 2),
    "shaped": (shaped, 1),
    "break": (broken, 2),
    "loader raises": (loader_raises, 2),
    "body raises": (body_raises, 2),
    "left before use": (left_before_use, 1),
    "empty": (empty, 1),
    "close": (closed, 1),
    "validation inside": (validation_inside, 1),
    "long": (long_loop, 1),
}


@pytest.mark.skipif(COMPILED is None, reason="markers._speedups has no DriverBase (not built)")
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compiled_and_pure_drivers_write_the_same_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    scenario, accumulation = SCENARIOS[name]
    pure, compiled = (play(tmp_path, monkeypatch, kind, scenario, accumulation) for kind in DRIVERS)
    assert compiled == pure
    assert any(r.get("phase") == wire.TRAINING_LOOP for r in pure) or name == "empty"


def loops(records: list[dict[str, int]]) -> list[tuple[int, int, int]]:
    return [
        (r["iteration"], r["flags"], r["batches"])
        for r in records
        if r.get("phase") == wire.TRAINING_LOOP
    ]


@pytest.mark.parametrize("kind", DRIVERS, ids=["pure", "compiled"])
def test_each_driver_writes_the_loops_spelled_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: Any
) -> None:
    if kind is None:
        pytest.skip("markers._speedups has no DriverBase (not built)")
    # 5 batches, 2 a step: two whole steps and a shorter last one.
    records = play(tmp_path, monkeypatch, kind, normal, 2)
    assert loops(records) == [(0, IN_ITERATION, 2), (1, IN_ITERATION, 2), (2, IN_ITERATION, 1)]
    loading = [r for r in records if r.get("phase") == wire.TRAINING_DATA_LOADING]
    assert [(r["iteration"], r["flags"]) for r in loading] == [
        (0, IN_ITERATION),
        (0, IN_ITERATION),
        (1, IN_ITERATION),
        (1, IN_ITERATION),
        (2, IN_ITERATION),
    ]
    # The loader raised while fetching the fourth batch (iteration 1's second): cut.
    records = play(tmp_path, monkeypatch, kind, loader_raises, 2)
    assert loops(records) == [(0, IN_ITERATION, 2), (1, CUT, 1)]
    # Left by the body's exception after the third batch: cut by the failed epoch.
    records = play(tmp_path, monkeypatch, kind, body_raises, 2)
    assert loops(records) == [(0, IN_ITERATION, 2), (1, CUT, 1)]
    # A break after the third batch, then two more in a new loop.
    records = play(tmp_path, monkeypatch, kind, broken, 2)
    assert loops(records) == [(0, IN_ITERATION, 2), (1, IN_ITERATION, 1), (2, IN_ITERATION, 2)]
    assert loops(play(tmp_path, monkeypatch, kind, empty, 1)) == []
    sizes = [
        (r["value"], r["iteration"], r["position"])
        for r in play(tmp_path, monkeypatch, kind, shaped, 1)
        if r.get("type") == wire.BATCH_SIZE
    ]
    # 2 given in the hello: sent when it changes, naming where from; fields that disagree
    # (iteration 4) and a size of 0 (iteration 5) read as the given size
    assert sizes == [(1, 2, 0), (3, 3, 0), (2, 4, 0), (3, 6, 0)]
    long = loops(play(tmp_path, monkeypatch, kind, long_loop, 1))
    assert long == [(i, IN_ITERATION, 1) for i in range(FLUSH_RECORDS // 2 + 150)]


def test_the_driver_selected_follows_the_switch() -> None:
    pure = os.environ.get("MARKERS_PURE_PYTHON", "") not in ("", "0")
    assert driver.ACCELERATED is (not pure and COMPILED is not None)
    assert run_module.Driver is driver.Driver
