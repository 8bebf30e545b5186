"""A fake CUDA event backend for markers.gpu.GpuTimer: runs without a GPU.

The fake stream numbers every recorded event; the test decides how far the "GPU" has got
(``done``), what each event's timestamp is, and what the allocator reads.
"""

from __future__ import annotations


class FakeEvent:
    def __init__(self) -> None:
        self.seq = None  # position on the fake stream of the latest record
        self.t_ms = None


class FakeBackend:
    """A single in-order stream whose progress the test controls."""

    device_uuid = "GPU-00000000-1111-2222-3333-444444444444"
    device_name = "Fake GPU"

    def __init__(self) -> None:
        self.recorded = 0  # events recorded so far
        self.done = 0  # the GPU has passed the first `done` events
        self.clock_ms = 0.0  # timestamp the next recorded event gets
        self.mem = [0, 0, 0, 0]  # current, peak, allocated (cumulative), freed (cumulative)
        self.new_events = 0
        self.resets = 0
        self.fail_record = False
        self.queries = 0
        self.later: tuple[int, int] | None = None  # (after this many queries, set done)

    # EventBackend
    def new_event(self) -> FakeEvent:
        self.new_events += 1
        return FakeEvent()

    def record(self, event: FakeEvent) -> None:
        if self.fail_record:
            raise RuntimeError("device gone")
        event.seq = self.recorded
        event.t_ms = self.clock_ms
        self.recorded += 1

    def query(self, event: FakeEvent) -> bool:
        self.queries += 1
        if self.later is not None and self.queries >= self.later[0]:
            self.done = max(self.done, self.later[1])
        return event.seq is None or event.seq < self.done

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        assert self.query(start) and self.query(end), "elapsed_ms on an incomplete event"
        return end.t_ms - start.t_ms

    def memory(self) -> tuple[int, int, int, int]:
        return tuple(self.mem)

    def reset_peak(self) -> None:
        self.resets += 1
        self.mem[1] = self.mem[0]

    # helpers for the tests: the allocator, as the phase's launches move it
    def alloc(self, n: int) -> None:
        self.mem[0] += n
        self.mem[2] += n
        self.mem[1] = max(self.mem[1], self.mem[0])

    def free(self, n: int) -> None:
        self.mem[0] -= n
        self.mem[3] += n

    def finish_all(self) -> None:
        self.done = self.recorded
