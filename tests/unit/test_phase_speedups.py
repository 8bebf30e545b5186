"""The compiled phase markers (markers/_speedups.c) write exactly the slots the pure-Python
ones (``markers.phase.PurePhase``) write: nested re-entry, ``begin``/``end``, the
decorator, the flush at ``flush_at`` and at the deadline, and the swap to ``GpuPhase``
and back that ``PhaseTable`` does. A scripted sequence runs through the real
``PhaseTable`` and ``RecordBuffer``, here on the path this process selected and in a
subprocess forced to pure Python; both must give the same slots, which are also spelled
out below (the same wrong answer twice would not pass). Every timestamp must come from
the clock ``time.perf_counter_ns`` reads, inside the step that should have taken it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from markers import phase, wire
from markers.buffer import RecordBuffer
from markers.gpu import GpuTimer
from markers.transport import Sender
from tests.support.fake_cuda import FakeBackend
from tests.support.helpers import env

try:
    from markers._speedups import PhaseBase

    COMPILED: type | None = PhaseBase
except ImportError:  # not built here: the compiled half of the comparison skips
    COMPILED = None

BASES = [phase.PurePhase, COMPILED]
BASE_IDS = ["pure", "compiled"]
FORWARD, BACKWARD = wire.FORWARD, wire.BACKWARD
CONTEXT = (wire.TAG_CONTEXT, -1, 0)  # the slot RecordBuffer starts with (no iteration)


class WatchedBuffer(RecordBuffer):
    """A real RecordBuffer that keeps the slots each flush found (the flush points)."""

    __slots__ = ("flushed",)

    def __init__(self, sender: Sender) -> None:
        super().__init__(sender, {"type": "hello"}, time.perf_counter_ns())
        self.flushed: list[list[int]] = []

    def flush(self) -> None:
        self.flushed.append(list(self.slots[: self.n]))
        super().flush()


class Steps:
    """Runs steps one at a time, noting the clock around each; the clock moves on between
    steps, so every timestamp belongs to exactly one step."""

    def __init__(self) -> None:
        self.brackets: list[tuple[int, int]] = []

    def __call__(self, step: Callable[[], object]) -> None:
        before = time.perf_counter_ns()
        step()
        after = time.perf_counter_ns()
        self.brackets.append((before, after))
        while time.perf_counter_ns() == after:
            pass

    def index(self, t_ns: int) -> int:
        """The step during which ``t_ns`` was read; fails when no step was running."""
        found = [i for i, (lo, hi) in enumerate(self.brackets) if lo <= t_ns <= hi]
        assert len(found) == 1, f"timestamp {t_ns} taken outside every step"
        return found[0]


def normalized(slots: list[int], steps: Steps) -> list[list[int]]:
    """Slots as triples; a phase's times replaced by the steps that took them, a GPU
    slot's lag (taken from the host clock) left out."""
    out = []
    for i in range(0, len(slots), wire.SLOT_WIDTH):
        tag, a, b = slots[i : i + wire.SLOT_WIDTH]
        kind = tag & wire.TAG_MASK
        if kind == wire.TAG_CONTEXT:
            out.append([kind, a, b])
        elif kind == wire.TAG_GPU:
            out.append([tag & 0xFFFF_FFFF, a, b])
        else:
            out.append([tag, steps.index(a), steps.index(b)])
    return out


def scripted_slots(folder: str) -> dict[str, Any]:
    """The scripted sequence on this process's markers: what each flush found, what was
    left unsent, and which path ran."""
    sender = Sender(f"ipc://{folder}/nobody.sock", b"r" * 16, 0)  # sends queue, unread
    buffer = WatchedBuffer(sender)
    buffer.deadline_ns = 1 << 62  # flushes only where the script asks for them
    buffer.flush_at = 6 * wire.SLOT_WIDTH  # the context and five phases
    table = phase.PhaseTable(buffer)
    forward, backward = table["forward"], table["backward"]
    steps = Steps()
    returned: list[int] = []

    @forward
    def decorated(x: int) -> int:
        return x + 1

    def far_deadline() -> None:
        buffer.deadline_ns = 1 << 62

    def passed_deadline() -> None:
        buffer.deadline_ns = time.perf_counter_ns()

    def nested() -> None:
        with forward:
            pass

    def use_gpu() -> None:
        buffer.use_gpu(GpuTimer(FakeBackend(), pool_size=8))  # a flush: it goes first
        table.use_gpu()
        far_deadline()

    script: list[Callable[[], object]] = [
        forward.__enter__,  # 0
        forward.__enter__,  # 1: inside itself: depth only
        backward.__enter__,  # 2
        lambda: backward.__exit__(None, None, None),  # 3: (backward, 2, 3)
        lambda: forward.__exit__(None, None, None),  # 4: depth back to 0
        lambda: forward.__exit__(None, None, None),  # 5: (forward, 0, 5)
        forward.begin,  # 6
        forward.end,  # 7: (forward, 6, 7)
        lambda: returned.append(decorated(1)),  # 8: (forward, 8, 8)
        nested,  # 9: (forward, 9, 9): the fifth slot, flush at flush_at
        far_deadline,  # 10
        passed_deadline,  # 11
        nested,  # 12: (forward, 12, 12): past the deadline, flush
        far_deadline,  # 13
        use_gpu,  # 14: the markers become GpuPhase
        forward.begin,  # 15
        forward.begin,  # 16: inside itself
        forward.end,  # 17
        forward.end,  # 18: (forward, 15, 18) and its GPU slot
        forward.begin,  # 19: entered, then the process forks:
        table.enter_child,  # 20: back to Phase, nothing entered
        nested,  # 21: (forward, 21, 21), no GPU slot
    ]
    for step in script:
        steps(step)
    assert returned == [2] and decorated.__name__ == "decorated"
    classes = [type(forward).__name__, type(backward).__name__]
    left = list(buffer.slots[: buffer.n])
    sender.close()
    return {
        "accelerated": phase.ACCELERATED,
        "flushed": [normalized(slots, steps) for slots in buffer.flushed],
        "left": normalized(left, steps),
        "classes": classes,
    }


EXPECTED = {
    "accelerated": phase.ACCELERATED,
    "flushed": [
        [  # flush_at: the fifth slot after the context
            list(CONTEXT),
            [BACKWARD, 2, 3],
            [FORWARD, 0, 5],
            [FORWARD, 6, 7],
            [FORWARD, 8, 8],
            [FORWARD, 9, 9],
        ],
        [list(CONTEXT), [FORWARD, 12, 12]],  # the deadline
        [list(CONTEXT)],  # buffer.use_gpu
    ],
    "left": [
        list(CONTEXT),
        [FORWARD, 15, 18],
        [wire.TAG_GPU, -1, -1],  # the GPU slot, pending until a flush polls its events
        [FORWARD, 21, 21],
    ],
    "classes": ["Phase", "Phase"],
}


def test_the_selected_path_writes_the_expected_slots(tmp_path: Path) -> None:
    assert scripted_slots(str(tmp_path)) == EXPECTED


def test_the_pure_python_path_writes_the_same_slots(tmp_path: Path) -> None:
    if not phase.ACCELERATED:
        pytest.skip("this process runs the pure-Python markers already")
    code = (
        "import json, sys; from tests.unit.test_phase_speedups import scripted_slots; "
        "print(json.dumps(scripted_slots(sys.argv[1])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env(**{phase.PURE_PYTHON_ENV: "1"}),
        timeout=120,
        check=True,
    )
    assert json.loads(result.stdout) == {**EXPECTED, "accelerated": False}


@pytest.fixture(params=BASES, ids=BASE_IDS)
def base(request: pytest.FixtureRequest) -> type[phase.PurePhase]:
    """Each implementation of the marker's state, enter and exit (the compiled one where
    it is built)."""
    if request.param is None:
        pytest.skip("markers._speedups is not built here")
    return request.param


@pytest.fixture
def buffer(tmp_path: Path) -> Any:
    sender = Sender(f"ipc://{tmp_path}/nobody.sock", b"r" * 16, 0)
    yield WatchedBuffer(sender)
    sender.close()


def test_an_exception_leaves_through_the_phase_and_its_slot_is_written(
    base: type[phase.PurePhase], buffer: WatchedBuffer
) -> None:
    marker = base(buffer, FORWARD)
    before = time.perf_counter_ns()
    with pytest.raises(ValueError, match="inside"), marker:
        raise ValueError("inside")
    after = time.perf_counter_ns()
    tag, start_ns, end_ns = buffer.slots[3:6]
    assert tag == FORWARD and before <= start_ns <= end_ns <= after
    assert buffer.n == 6 and marker._start == 0


def test_the_state_stays_readable_and_writable_from_python(
    base: type[phase.PurePhase], buffer: WatchedBuffer
) -> None:
    marker = base(buffer, BACKWARD)
    assert (marker._start, marker._depth, marker._slot, marker.phase_id) == (0, 0, -1, BACKWARD)
    marker.begin()
    marker.begin()
    assert marker._start > 0 and marker._depth == 1
    marker._start = marker._depth = 0  # what PhaseTable.enter_child does to an open one
    marker._slot = 7
    assert (marker._start, marker._depth, marker._slot) == (0, 0, 7)
    marker.end()  # ends an entry with start 0: the slot says so, as in Python
    assert list(buffer.slots[3:5]) == [BACKWARD, 0]


def test_subclasses_of_either_base_swap_class_as_phase_table_does(
    base: type[phase.PurePhase], buffer: WatchedBuffer
) -> None:
    class Cpu(base):  # type: ignore[valid-type, misc]
        __slots__ = ()

    entered: list[type] = []

    class Gpu(Cpu):
        __slots__ = ()

        def __enter__(self) -> Gpu:
            entered.append(type(self))
            return super().__enter__()

    marker = Cpu(buffer, FORWARD)
    marker.__class__ = Gpu
    marker.begin()  # begin goes through the subclass's own __enter__
    assert entered == [Gpu]
    marker.__class__ = Cpu
    marker.end()
    assert list(buffer.slots[3:4]) == [FORWARD] and marker._start == 0
