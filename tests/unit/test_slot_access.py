"""The accelerator reads and writes the markers' ``__slots__`` attributes at their offset
(markers/_slots.c), resolved once per type: what it reads and writes must stay what
Python's own attribute access gives when a class changes after the first use, when two
classes lay out the same names differently, and when a slot is unset. Driven through
``PhaseBase``'s exit, which reads and writes the buffer's ``n``, ``slots``,
``flush_at`` and ``deadline_ns``."""

from __future__ import annotations

from array import array
from typing import Any

import pytest

_speedups = pytest.importorskip("markers._speedups", reason="markers._speedups is not built")
PHASE_ID = 7
FAR_NS = 2**62  # a deadline never reached


class Buffer:
    """The four attributes a phase's exit uses, and its flush."""

    __slots__ = ("deadline_ns", "flush_at", "flushes", "n", "slots")

    def __init__(self, n: int = 0) -> None:
        self.slots = array("q", bytes(8 * 64))
        self.n, self.flush_at, self.deadline_ns, self.flushes = n, 60, FAR_NS, 0

    def flush(self) -> None:
        self.flushes += 1


class Shuffled:
    """The same names in another order, behind a padding slot: other offsets."""

    __slots__ = ("pad", "slots", "n", "deadline_ns", "flush_at", "flushes")  # noqa: RUF023
    flush = Buffer.flush
    __init__ = Buffer.__init__


def phase_through(buffer: Any) -> None:
    with _speedups.PhaseBase(buffer, PHASE_ID):
        pass


def test_two_layouts_of_the_same_names_each_get_their_own_slots() -> None:
    first, second = Buffer(), Shuffled(n=9)
    for _ in range(3):
        phase_through(first)
        phase_through(second)
    assert (first.n, second.n) == (9, 18)
    assert [first.slots[i] for i in (0, 3, 6)] == [PHASE_ID] * 3
    assert [second.slots[i] for i in (9, 12, 15)] == [PHASE_ID] * 3
    assert second.slots[0] == 0  # nothing written where the other layout's n points


def test_a_class_changed_after_first_use_is_followed() -> None:
    """``n`` turned into a property once the exit has used the slot: the next exit reads
    and writes through the property, as Python's attribute access does."""

    class Changing(Buffer):
        __slots__ = ("seen",)
        seen: int

    buffer = Changing()
    phase_through(buffer)
    assert buffer.n == 3
    Changing.n = property(lambda self: 30, lambda self, value: setattr(self, "seen", value))  # type: ignore[assignment,misc]
    phase_through(buffer)
    assert buffer.seen == 33 and buffer.slots[30] == PHASE_ID


def test_a_custom_getattribute_is_used() -> None:
    class Counting(Buffer):
        __slots__ = ("reads",)
        reads: int

        def __getattribute__(self, name: str) -> Any:
            if name == "n":
                object.__setattr__(self, "reads", object.__getattribute__(self, "reads") + 1)
            return object.__getattribute__(self, name)

    buffer = Counting()
    buffer.reads = 0
    phase_through(buffer)
    phase_through(buffer)
    assert buffer.n == 6 and buffer.reads == 3  # two exits' reads and the assert's


def test_an_unset_slot_raises_as_python_does() -> None:
    buffer = Buffer()
    del buffer.n
    with pytest.raises(AttributeError, match="n"):
        phase_through(buffer)
    buffer.n = 0
    phase_through(buffer)
    assert buffer.n == 3
