"""Phase markers: what ``with run.phase("forward"):`` enters and exits, and the table
that hands them out by name.

The hot path (a phase's enter and exit on a CPU) is two ``perf_counter_ns`` calls, one
slot packed into the preallocated ``markers.buffer.RecordBuffer`` and one comparison; the
buffer goes out as one message every ``FLUSH_RECORDS`` records or ``FLUSH_AGE_NS``,
whichever comes first. ``run.phase`` is the table's own ``dict.__getitem__`` (no Python
frame). ``Phase`` takes that path from ``markers._speedups.PhaseBase`` (C, built at install
when a compiler is there: no Python frame at all) or else from ``PurePhase``, the same
semantics in Python; ``ACCELERATED`` says which. Keep these classes lean:
docs/architecture.md ("The hot path") says why their layout matters.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self, TypeVar

from markers import wire
from markers.buffer import RecordBuffer, pack_slot

perf_counter_ns = time.perf_counter_ns

F = TypeVar("F", bound=Callable[..., Any])

# MARKERS_PURE_PYTHON=1 keeps the markers on PurePhase even where the accelerator is
# built (the tests run both paths). An environment variable is the right switch only
# because the choice is made once, here, at import: nothing reads it again.
PURE_PYTHON_ENV = "MARKERS_PURE_PYTHON"


class PurePhase:
    """A phase marker's state, enter and exit in Python: the reference semantics, and the
    fallback where ``markers._speedups`` is not built.

    ``__exit__`` packs three integers into the buffer inline and compares once: it runs
    at every phase of every step. A phase entered again inside itself (a decorated helper
    called within the same phase) is one measurement, the outer one: the inner entries
    only count their depth.
    """

    __slots__ = ("_buffer", "_depth", "_id", "_slot", "_start")

    def __init__(self, buffer: RecordBuffer, phase_id: int) -> None:
        self._buffer = buffer
        self._id = phase_id
        self._start = 0  # 0: not entered
        self._slot = -1  # the GPU timer slot of the current entry (GpuPhase)
        self._depth = 0  # entries inside the open one

    @property
    def phase_id(self) -> int:
        """The phase's id on the wire."""
        return self._id

    def __enter__(self) -> Self:
        if self._start:  # entered again inside itself: the outer entry measures
            self._depth += 1
            return self
        self._start = perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if self._depth:
            self._depth -= 1
            return
        end_ns = perf_counter_ns()
        buffer = self._buffer
        n = buffer.n
        pack_slot(buffer.slots, n << 3, self._id, self._start, end_ns)
        buffer.n = n = n + 3
        self._start = 0
        if n >= buffer.flush_at or end_ns >= buffer.deadline_ns:
            buffer.flush()

    def begin(self) -> None:
        """Start the phase now (for hooks and callbacks that cannot use ``with``)."""
        self.__enter__()

    def end(self) -> None:
        """End the phase started by ``begin``."""
        self.__exit__(None, None, None)


def _phase_base() -> type:
    """The compiled base when it is built and not switched off, else ``PurePhase``."""
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return PurePhase
    try:
        from markers._speedups import PhaseBase
    except ImportError:  # not built: no compiler or no Python headers at install
        return PurePhase
    return PhaseBase


if TYPE_CHECKING:
    _PhaseBase = PurePhase
else:
    _PhaseBase = _phase_base()
ACCELERATED: bool = _PhaseBase is not PurePhase


class Phase(_PhaseBase):
    """A reusable phase marker: ``with run.phase("forward"):`` or ``@run.phase("x")``.

    Enter, exit, ``begin``, ``end`` and ``phase_id`` come from the base (``PurePhase``
    says what they do). Once the script uses CUDA the Run turns its markers into
    ``GpuPhase`` (same slots), so the CPU path carries no GPU test.
    """

    __slots__ = ()

    def __call__(self, function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class GpuPhase(Phase):
    """A phase marker that also records CUDA events (``markers.gpu``); never waits."""

    __slots__ = ()

    @property
    def phase_id(self) -> int:
        """The phase's id on the wire."""
        return self._id

    def __enter__(self) -> Self:
        if self._start:
            self._depth += 1
            return self
        self._slot = self._buffer.gpu.begin()
        self._start = perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if self._depth:
            self._depth -= 1
            return
        end_ns = perf_counter_ns()
        buffer = self._buffer
        buffer.gpu.end(self._slot)
        # Entered before CUDA came up (slot -1): recorded as "GPU not measured".
        buffer.record_gpu(self._id, self._start, end_ns, self._slot)
        self._start, self._slot = 0, -1


class NullPhase:
    """A phase marker that measures nothing (a refused name, or a run not monitored)."""

    __slots__ = ()

    def __enter__(self) -> NullPhase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def begin(self) -> None:
        """Does nothing."""

    def end(self) -> None:
        """Does nothing."""

    def __call__(self, function: F) -> F:
        return function


NULL_PHASE = NullPhase()


class PhaseTable(dict[str, "Phase | NullPhase"]):
    """The phase markers of a run by name. A name seen for the first time gets its marker
    from ``__missing__``: a standard one (forward, backward, optimization, evaluation,
    metrics) or a custom name, declared to the sidecar with the next free id; later
    lookups are plain dict hits. A refused name is kept too, as ``NULL_PHASE``, so it
    warns once.
    """

    __slots__ = ("_buffer", "_next_custom")

    def __init__(self, buffer: RecordBuffer) -> None:
        super().__init__()
        self._buffer = buffer
        self._next_custom = wire.FIRST_CUSTOM_ID

    def __missing__(self, name: str) -> Phase | NullPhase:
        marker = self[name] = self._new(name)
        return marker

    def _new(self, name: str) -> Phase | NullPhase:
        kind = Phase if self._buffer.gpu is None else GpuPhase
        phase_id = wire.CANONICAL_PHASE_NAMES.get(name)
        if phase_id is not None:
            return kind(self._buffer, phase_id)
        try:
            clean = wire.custom_phase_name(str(name))
        except ValueError as exc:
            # stacklevel 3: this, __missing__, the script's run.phase(...)
            warnings.warn(
                f"markers: phase {name!r} refused ({exc}); it is not measured",
                RuntimeWarning,
                stacklevel=3,
            )
            return NULL_PHASE
        same = self.get(clean)  # "a\tb" is the phase "a b"
        if same is not None:
            return same
        if self._next_custom - wire.FIRST_CUSTOM_ID >= wire.MAX_CUSTOM_PHASES:
            warnings.warn(
                f"markers: phase {name!r} refused (more than "
                f"{wire.MAX_CUSTOM_PHASES} custom phases); it is not measured",
                RuntimeWarning,
                stacklevel=3,
            )
            return NULL_PHASE
        phase_id = self._next_custom
        self._next_custom += 1
        self._buffer.declare(phase_id, clean)
        marker = self[clean] = kind(self._buffer, phase_id)
        return marker

    def markers(self) -> list[Phase]:
        """The measuring markers handed out so far."""
        return [m for m in self.values() if isinstance(m, Phase)]

    def use_gpu(self) -> None:
        """GPU timing started: every marker records CUDA events from its next entry."""
        for marker in self.markers():
            marker.__class__ = GpuPhase

    def enter_child(self) -> None:
        """In a forked child: back to the CPU path, nothing entered."""
        for marker in self.markers():
            marker.__class__ = Phase
            marker._start = marker._depth = 0
