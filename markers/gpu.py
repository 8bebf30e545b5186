"""GPU time, GPU start and peak memory of a phase, measured without waiting for the GPU.

The Run calls :meth:`GpuTimer.begin` when a phase starts and :meth:`GpuTimer.end` when it
stops. Both record a CUDA event on the current stream of the timer's device (chosen by
``markers.cuda.choose_device``) and read the caching allocator's statistics; neither
waits. The GPU time is known only once the GPU has reached the end event, so the Run keeps
its records in FIFO order and calls :meth:`GpuTimer.poll` (``Event.query()``, never a
wait) on the pending ones at flush time. At finish, :meth:`GpuTimer.drain` waits a
bounded time for what is still in flight.

GPU start. The GPU runs a phase's work after the host launched it, often much later.
``poll`` also says when, on the host clock: one *anchor* event recorded when the timer
opens is the reference, ``anchor.elapsed_time(start)`` places every start event on the
GPU's timeline, and the host time of the anchor on that timeline is estimated from the
fact that the GPU never runs an event before the host recorded it: it is the largest
``host start - GPU offset`` seen so far (exact as soon as the GPU was idle once when a
phase began), allowed to fall by the measured drift of the GPU clock against the host's
(``drift_per_ns``: the median slope of the best bound of consecutive ``DRIFT_WINDOW_NS``
windows; a constant lag cancels out of it) times the time since the bound that last set
it. So a GPU clock running slightly fast is followed, and a loop that stays ahead of its
GPU for hours keeps its lag: it falls only as fast as the clocks really drift apart,
never at an assumed rate. The anchor is renewed every ``REANCHOR_NS`` (a new event,
placed on the old one's timeline once the GPU passed it): CUDA's elapsed times are
float32 milliseconds, whose step grows with the span (8 ms after a day from one
anchor); the chained renewals add microseconds. The lag (GPU start minus
host start, >= 0) lets the sidecar attribute GPU utilization and power to the phases
the GPU was really running (``docs/samplers.md``).

CUDA graph capture. Inside ``torch.cuda.graph()`` events recorded on the capturing stream
become graph nodes, never timing events, and querying an event makes the capture fail.
So ``begin``/``end`` record nothing while the current stream is capturing (the phase is
sent as "GPU not measured", counted in :attr:`GpuTimer.captured`), and the Run polls
nothing while a capture is under way.

Nothing in this module synchronizes the device, calls ``Event.synchronize()`` or reads a
tensor back to the host, and it never imports torch: :func:`open_gpu_timer` only looks at
the ``torch`` the training script already imported, and returns None until CUDA is
initialized there, so a CPU-only run makes no ``torch.cuda`` call beyond
``is_initialized()``.

Peak memory (``peak_memory=`` of :func:`open_gpu_timer`, see ``docs/gpu-timing.md``):

* ``"bound"`` (default): never resets the allocator's peak statistics, so the user's own
  ``torch.cuda.max_memory_allocated()`` keeps its meaning. The phase's peak is exact when
  the phase raised the process high-water mark, when it allocated nothing, or when it freed
  nothing; otherwise the value is an upper bound (see :func:`phase_peak`), and
  :attr:`GpuTimer.inexact_peaks` counts those phases. Under ``cudaMallocAsync`` every
  peak is an upper bound.
* ``"reset"``: ``torch.cuda.reset_peak_memory_stats()`` at every begin. Exact (an upper
  bound under ``cudaMallocAsync``), but it wipes every peak statistic of the device for
  the whole process, the user's included, and a phase nested inside another cuts the
  outer one's peak short.
* ``"off"``: no allocator reads; peaks are -1.

One GpuTimer serves one thread (the training loop's); it holds no locks.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, Protocol

from markers.cuda import Memory

PEAK_MODES = ("bound", "reset", "off")

# (gpu_ns, peak_bytes, lag_ns) of a slot that holds no measurement
NOT_MEASURED = (-1, -1, 0)
# The anchor is renewed this often (host time): CUDA gives elapsed times in float32
# milliseconds, whose step grows with the span (8 ms at a day, 4 us at a minute), so
# offsets from an anchor at most about this old stay within a few microseconds.
REANCHOR_NS = 60 * 10**9
# The drift of the GPU clock against the host's is measured, not assumed: the largest start
# bound of each window this long, and the median slope between consecutive windows' (a lag
# that stays the same moves every bound alike, so it cancels out of the slope).
DRIFT_WINDOW_NS = 10 * 10**9
DRIFT_WINDOWS = 64  # windows whose slopes the median takes

# Slot states. _FAILED: end() could not finish after the start event was recorded (or
# the phase ended inside a graph capture); the slot polls as NOT_MEASURED once, then is free.
_FREE, _STARTED, _ENDED, _FAILED = 0, 1, 2, 3


class EventBackend(Protocol):
    """What GpuTimer needs from the device. ``markers.cuda.TorchCudaBackend`` is the real
    one; ``exact_peaks`` is False where the allocator keeps no cumulative counters."""

    device_uuid: str
    device_name: str
    exact_peaks: bool

    def new_event(self) -> Any:
        """A timing event, made once when the pool is built and reused afterwards."""

    def record(self, event: Any) -> None:
        """Record ``event`` on the current stream of the timer's device; never waits."""

    def query(self, event: Any) -> bool:
        """True once the GPU has passed ``event``; never waits."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed events."""

    def memory(self) -> Memory:
        """The allocator's ``allocated_bytes.all`` statistics, read on the host."""

    def reset_peak(self) -> None:
        """Reset the device's peak statistics (only for ``peak_memory="reset"``)."""

    def capturing(self) -> bool:
        """True while the current stream is capturing a CUDA graph."""


def phase_peak(before: Memory, after: Memory) -> tuple[int, bool]:
    """Peak allocated bytes of a phase from readings at its begin and end, and whether exact.

    Only the phase's own allocations and frees move the statistics between the readings
    (one thread launches the work; the allocator counts at launch time, on the host).
    With ``current`` c, high-water mark m, cumulative ``allocated`` a and ``freed`` f:

    * counters absent (``a`` is -1: ``cudaMallocAsync`` keeps none, and its current and
      peak are the driver's view of the pool, which frees in stream order): the mark at
      the end ``m1`` bounds the phase's peak from above; it is returned, marked inexact.
    * ``m1 > m0``: the phase raised the process high-water mark, so its peak *is* ``m1``.
    * no bytes allocated (``a1 == a0``): memory only fell, the peak was ``c0``.
    * no bytes freed (``f1 == f0``): memory only rose, the peak is ``c1``.
    * if the counters do not add up (``c1 - c0 != (a1 - a0) - (f1 - f0)``), the mark ``m0``
      is the only bound left; it is returned, marked inexact.
    * otherwise the peak lies in ``[max(c0, c1), min(m0, c0 + a1 - a0)]``: never above the
      old mark (it was not raised) nor above the start plus everything allocated. The upper
      end is returned, marked inexact: a "max memory" figure that may over-state, never
      under-state, what the phase held. It is tight for phases that keep most of what they
      allocate (forward) and for phases that reach the iteration's usual high-water mark
      (backward after the first iteration).
    """
    c0, m0, a0, f0 = before
    c1, m1, a1, f1 = after
    if a0 < 0 or a1 < 0:
        return max(m1, c0, c1), False
    if m1 > m0:
        return m1, True
    if c1 - c0 != (a1 - a0) - (f1 - f0):
        # The cumulative counters do not account for the change: only the mark bounds it.
        return max(m0, c0, c1), False
    if a1 == a0:
        return c0, True
    if f1 == f0:
        return c1, True
    low = max(c0, c1)
    high = min(m0, c0 + (a1 - a0))
    return (low, True) if high <= low else (high, False)


class GpuTimer:
    """A bounded pool of CUDA event pairs that times phases without waiting.

    ``begin()`` returns a slot id (or -1 when all slots are in flight: ``dropped`` counts
    it; or during a graph capture: ``captured`` counts it; nothing blocks); ``end(slot)``
    closes it; ``poll(slot, host_start_ns)`` gives ``(gpu_ns, peak_bytes, lag_ns)`` once
    the GPU has passed the end event and frees the slot for reuse. ``peak_bytes`` is -1
    with ``peak_memory="off"``; ``lag_ns`` is how long after ``host_start_ns`` (the
    phase's ``perf_counter_ns`` start) the GPU reached the start event, 0 when unknown. A
    slot whose measurement failed, and slot -1, poll as ``NOT_MEASURED``.
    """

    def __init__(
        self,
        backend: EventBackend,
        pool_size: int = 256,
        peak_memory: str = "bound",
        now_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        if peak_memory not in PEAK_MODES:
            raise ValueError(f"peak_memory must be one of {PEAK_MODES}, not {peak_memory!r}")
        self._backend = backend
        self.device_uuid: str = backend.device_uuid
        self.device_name: str = backend.device_name
        self.peak_memory = peak_memory
        self.dropped = 0  # measurements lost: pool dry, a device call failed, drain gave up
        self.captured = 0  # phases begun or ended inside a CUDA graph capture: not timed
        self.inexact_peaks = 0  # phases whose peak_bytes is an upper bound
        self._exact = bool(getattr(backend, "exact_peaks", True))
        # Everything is allocated here, once: two events, a state and readings per slot.
        self._starts = [backend.new_event() for _ in range(pool_size)]
        self._ends = [backend.new_event() for _ in range(pool_size)]
        self._state = [_FREE] * pool_size
        self._before: list[Memory | None] = [None] * pool_size
        self._peak = [-1] * pool_size
        self._free = list(range(pool_size - 1, -1, -1))  # a stack: pop() gives slot 0 first
        self._record = backend.record
        self._query = backend.query
        self.capturing = backend.capturing
        self._read = None if peak_memory == "off" else backend.memory
        self._reset = backend.reset_peak if peak_memory == "reset" else None
        # The anchor: its host time on the GPU's timeline, estimated (module docstring).
        self._now = now_ns  # the host clock (perf_counter_ns; a test's own)
        self._anchor = backend.new_event()
        self._anchor_ns = 0  # 0: no anchor (it could not be recorded)
        self._anchor_bound_ns = 0  # the bound that last set the estimate
        self._anchor_seen_ns = 0  # host start of the phase whose bound that was
        self._anchored_ns = 0  # host time the anchor was recorded
        self._renewal: Any = None  # the next anchor's event, made at the first renewal
        self._renewal_ns = 0  # host time it was recorded; 0: none in flight
        # The drift measurement: this window's [start, host time of its best bound, that
        # bound], and the best (host time, bound) of the windows before.
        self._window: list[int] = []
        self._maxima: deque[tuple[int, int]] = deque(maxlen=DRIFT_WINDOWS)
        self.drift_per_ns = 0.0  # measured: how fast the anchor's host time falls
        self._place_anchor()

    @property
    def pool_size(self) -> int:
        return len(self._state)

    @property
    def in_flight(self) -> int:
        """Slots begun and not yet resolved."""
        return len(self._state) - len(self._free)

    def _place_anchor(self) -> None:
        if self.capturing():
            return
        try:
            self._record(self._anchor)
        except Exception:
            return
        # The GPU cannot run the anchor before it was recorded: a first lower bound.
        self._anchor_ns = self._anchor_bound_ns = self._anchor_seen_ns = self._now()
        self._anchored_ns = self._anchor_ns

    def begin(self) -> int:
        """Record a start event on the current stream; a slot id, or -1 when the pool is
        dry or a graph capture is under way."""
        free = self._free
        if not free:
            self.dropped += 1
            return -1
        if self.capturing():
            self.captured += 1
            return -1
        slot = free.pop()
        try:
            # Allocator first, event last: host work between the two events would count as
            # GPU time whenever the GPU is idle, waiting for the next launch.
            if self._reset is not None:
                self._reset()
            elif self._read is not None:
                self._before[slot] = self._read()
            self._record(self._starts[slot])
        except Exception:
            free.append(slot)
            self.dropped += 1
            return -1
        self._state[slot] = _STARTED
        return slot

    def end(self, slot: int) -> None:
        """Record the end event of ``slot`` (no-op for -1) and settle its peak memory."""
        if slot < 0 or self._state[slot] != _STARTED:
            return
        if self.capturing():  # begun outside the capture, ended inside: not timed
            self.captured += 1
            self._state[slot] = _FAILED
            return
        try:
            self._record(self._ends[slot])  # event first, allocator after: see begin()
            if self._read is not None:
                after = self._read()
                if self._reset is not None:
                    # The reset at begin set the mark to the then-current allocation, so
                    # the mark now is this phase's peak.
                    self._peak[slot] = after[1]
                    exact = self._exact
                else:
                    before = self._before[slot]
                    assert before is not None  # read at the begin, under the same condition
                    self._peak[slot], exact = phase_peak(before, after)
                if not exact:
                    self.inexact_peaks += 1
        except Exception:
            self.dropped += 1
            self._state[slot] = _FAILED
            return
        self._state[slot] = _ENDED

    def poll(self, slot: int, host_start_ns: int = 0) -> tuple[int, int, int] | None:
        """``(gpu_ns, peak_bytes, lag_ns)`` once the GPU has passed the end event, else
        None. ``host_start_ns`` is the phase's host start (``perf_counter_ns``), which
        places the GPU start on the host clock (``lag_ns``; 0 when not given or unknown).

        Never waits (``Event.query()``); the caller must not poll while ``capturing()``.
        A resolved slot is released and may be handed out again by the next ``begin()``,
        so poll each slot until it resolves, once.
        """
        if slot < 0:
            return NOT_MEASURED
        state = self._state[slot]
        if state == _ENDED:
            try:
                end = self._ends[slot]
                start = self._starts[slot]
                # The start event is queried too: if the phase ended on another stream than
                # it began, the end event completing says nothing about the start.
                if not (self._query(end) and self._query(start)):
                    return None
                ms = self._backend.elapsed_ms(start, end)
            except Exception:
                self._release(slot)
                self.dropped += 1
                return NOT_MEASURED
            lag_ns = self._lag_ns(start, host_start_ns) if host_start_ns else 0
            self._release(slot)
            return round(ms * 1_000_000), self._peak[slot], lag_ns
        if state == _FAILED:
            self._release(slot)
            return NOT_MEASURED
        return None  # begun, not ended: pending

    def _lag_ns(self, start: Any, host_start_ns: int) -> int:
        """How long after ``host_start_ns`` the GPU reached ``start`` (>= 0; 0 unknown)."""
        if not self._anchor_ns:
            return 0
        try:
            self._renew_anchor()
        except Exception:  # the old anchor stays; a new one is tried next period
            self._renewal_ns = 0
        try:
            offset_ns = round(self._backend.elapsed_ms(self._anchor, start) * 1_000_000)
        except Exception:
            return 0
        bound = host_start_ns - offset_ns
        self._measure_drift(host_start_ns, bound)
        self._take_bound(host_start_ns, bound)
        return max(0, self._anchor_ns + offset_ns - host_start_ns)

    def _take_bound(self, host_ns: int, bound: int) -> None:
        """The GPU ran an event recorded at ``host_ns`` no earlier than that: the anchor's
        host time is at least ``bound``. Keep the largest such bound; let it fall no faster
        than the measured drift of the clocks."""
        # The allowance runs from the last bound that set the estimate (``_anchor_bound_ns``
        # at ``_anchor_seen_ns``), not from the previous estimate: lowered by every poll,
        # it would compound, and in a loop that never lets the GPU idle (every bound
        # below) the lag would collapse to 0.
        floor = self._anchor_bound_ns - int(
            max(0, host_ns - self._anchor_seen_ns) * self.drift_per_ns
        )
        if bound >= floor:
            self._anchor_ns = self._anchor_bound_ns = bound
            self._anchor_seen_ns = host_ns
        else:
            self._anchor_ns = floor

    def _measure_drift(self, host_ns: int, bound: int) -> None:
        """Note a start bound: each ``DRIFT_WINDOW_NS`` window keeps its largest; at a new
        window, the drift is the median slope between the windows' (how fast the best
        bounds fall; 0 when they do not)."""
        window = self._window
        if window and host_ns - window[0] < DRIFT_WINDOW_NS:
            if bound > window[2]:
                window[1], window[2] = host_ns, bound
            return
        if window:
            self._maxima.append((window[1], window[2]))
            slopes = [(b1 - b0) / (h1 - h0) for (h0, b0), (h1, b1) in pairwise(self._maxima)]
            if slopes:  # the median (the upper one of an even count)
                self.drift_per_ns = max(0.0, -sorted(slopes)[len(slopes) // 2])
        self._window = [host_ns, host_ns, bound]

    def _renew_anchor(self) -> None:
        """Every ``REANCHOR_NS``, record a new anchor; once the GPU passed it, place it on
        the old one's timeline and use it. Never waits; a failure leaves the old one."""
        if self._renewal_ns:
            if not self._query(self._renewal):
                return
            shift_ns = round(self._backend.elapsed_ms(self._anchor, self._renewal) * 1_000_000)
            self._anchor, self._renewal = self._renewal, self._anchor
            # every host time of the old anchor's timeline moves to the new one's
            self._anchor_ns += shift_ns
            self._anchor_bound_ns += shift_ns
            if self._window:
                self._window[2] += shift_ns
            self._maxima = deque(((h, b + shift_ns) for h, b in self._maxima), DRIFT_WINDOWS)
            recorded_ns, self._renewal_ns = self._renewal_ns, 0
            self._anchored_ns = recorded_ns
            self._take_bound(recorded_ns, recorded_ns)  # it ran no earlier than recorded
            return
        now_ns = self._now()
        if now_ns - self._anchored_ns < REANCHOR_NS or self.capturing():
            return
        self._anchored_ns = now_ns  # tried now: after a failure, again next period
        if self._renewal is None:
            self._renewal = self._backend.new_event()
        self._record(self._renewal)
        self._renewal_ns = now_ns

    def drain(
        self, slots: Sequence[int], timeout_s: float, host_starts: Sequence[int] | None = None
    ) -> list[tuple[int, int, int] | None]:
        """At finish only: wait up to ``timeout_s`` for ``slots``, then give up on the rest.

        Training is over, so waiting is allowed here; it is bounded all the same, by
        polling ``Event.query()`` with short sleeps rather than ``Event.synchronize()``,
        which could hang on a wedged device. Slots whose ``end()`` never came, or that have
        not completed by the deadline, are released, counted in ``dropped`` and returned
        as None. ``host_starts`` are the phases' host starts (see ``poll``).
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        starts = list(host_starts) if host_starts is not None else [0] * len(slots)
        out: list[tuple[int, int, int] | None] = [None] * len(slots)
        pending: list[int] = []
        for i, slot in enumerate(slots):
            if slot < 0:
                out[i] = NOT_MEASURED
            elif self._state[slot] == _STARTED:
                self._give_up(slot)  # its end() never came: it cannot complete
            elif self._state[slot] != _FREE:  # a free slot has nothing left to wait for
                pending.append(i)
        pause = 0.0005
        while pending:
            still: list[int] = []
            capturing = self.capturing()
            for i in pending:
                res = None if capturing else self.poll(slots[i], starts[i])
                if res is None:
                    still.append(i)
                else:
                    out[i] = res
            pending = still
            if not pending:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                for i in pending:
                    self._give_up(slots[i])
                break
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)
        return out

    def _release(self, slot: int) -> None:
        self._state[slot] = _FREE
        self._before[slot] = None
        self._free.append(slot)

    def _give_up(self, slot: int) -> None:
        if self._state[slot] != _FREE:
            self._release(slot)
            self.dropped += 1


def open_gpu_timer(
    pool_size: int = 256,
    backend: EventBackend | None = None,
    peak_memory: str = "bound",
    device: Any = None,
) -> GpuTimer | None:
    """A GpuTimer for the training's CUDA device, or None when there is nothing to time.

    Without ``backend``: None unless the script has already imported torch (this function
    never imports it) and ``torch.cuda.is_initialized()``; on a CPU-only run that is the
    only ``torch.cuda`` call made. The device is ``markers.cuda.choose_device(device)``.
    The Run calls this at loop starts and every 100 steps until it returns a timer.
    Never raises for a device problem: it returns None instead.
    """
    if pool_size < 1 or peak_memory not in PEAK_MODES:  # a caller's mistake: say so
        raise ValueError(f"pool_size >= 1 and peak_memory in {PEAK_MODES} are required")
    if backend is not None:
        return GpuTimer(backend, pool_size, peak_memory)
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        from markers.cuda import TorchCudaBackend, choose_device

        index, chosen_by = choose_device(torch.cuda, device)
        return GpuTimer(TorchCudaBackend(torch, index, chosen_by), pool_size, peak_memory)
    except Exception:
        return None
