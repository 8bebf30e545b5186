"""GPU time and peak memory of a phase, measured without waiting for the GPU.

The Run calls :meth:`GpuTimer.begin` when a phase starts and :meth:`GpuTimer.end` when it
stops. Both record a CUDA event on the *current stream* of the timer's device and read the
caching allocator's statistics; neither waits. The GPU time is known only once the GPU has
reached the end event, so the Run keeps its records in FIFO order and calls
:meth:`GpuTimer.poll` (``Event.query()``, never a wait) on the pending ones at flush time.
At finish, :meth:`GpuTimer.drain` waits a bounded time for what is still in flight.

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
  :attr:`GpuTimer.inexact_peaks` counts those phases.
* ``"reset"``: ``torch.cuda.reset_peak_memory_stats()`` at every begin. Exact, but it
  wipes every peak statistic of the device for the whole process, the user's included,
  and a phase nested inside another cuts the outer one's peak short.
* ``"off"``: no allocator reads; peaks are -1.

One GpuTimer serves one thread (the training loop's); it holds no locks.
"""

from __future__ import annotations

import sys
import time
import uuid as _uuid
from collections.abc import Sequence
from typing import Any, Protocol

PEAK_MODES = ("bound", "reset", "off")

# A reading of the allocator's "allocated_bytes.all" statistics, in bytes:
# (current, peak = process high-water mark, allocated = cumulative bytes allocated,
#  freed = cumulative bytes freed).
Memory = tuple[int, int, int, int]

NOT_MEASURED = (-1, -1)  # what poll/drain give for a slot that holds no measurement

# Slot states. _FAILED: end() could not finish after the start event was recorded; the
# slot polls as NOT_MEASURED once, then is free.
_FREE, _STARTED, _ENDED, _FAILED = 0, 1, 2, 3


class EventBackend(Protocol):
    """What GpuTimer needs from the device. ``TorchCudaBackend`` is the real one."""

    device_uuid: str
    device_name: str

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


def format_uuid(raw: Any) -> str:
    """A device UUID formatted as NVML prints it: ``GPU-`` + the canonical lower-case UUID.

    ``raw`` is ``torch.cuda.get_device_properties(d).uuid``: an object with ``bytes`` (16
    of them) on recent torch, else something whose ``str()`` is the UUID.
    """
    data = getattr(raw, "bytes", None)
    if data is not None:
        return "GPU-" + str(_uuid.UUID(bytes=bytes(data)))
    text = str(raw).strip()
    if text.upper().startswith(("GPU-", "MIG-")):
        return text[:4].upper() + text[4:].lower()
    try:
        return "GPU-" + str(_uuid.UUID(text))
    except ValueError:
        return "GPU-" + text.lower()


class TorchCudaBackend:
    """CUDA events and allocator statistics of one device, through the imported torch."""

    def __init__(self, torch: Any, device: int | None = None) -> None:
        cuda = torch.cuda
        self._cuda = cuda
        self.device = cuda.current_device() if device is None else int(device)
        props = cuda.get_device_properties(self.device)
        self.device_uuid = format_uuid(props.uuid)
        self.device_name = str(props.name)
        self._event = cuda.Event
        self._current_stream = cuda.current_stream
        # Nested stats straight from the allocator: the flat torch.cuda.memory_stats()
        # costs a Python flatten and sort of ~150 keys on every call.
        self._stats = cuda.memory_stats_as_nested_dict

    def new_event(self) -> Any:
        return self._event(enable_timing=True)

    def record(self, event: Any) -> None:
        # The stream is named explicitly so that a script switching devices with
        # torch.cuda.set_device() cannot make a pooled event record on a foreign device.
        event.record(self._current_stream(self.device))

    def query(self, event: Any) -> bool:
        return event.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end)

    def memory(self) -> Memory:
        s = self._stats(self.device)["allocated_bytes"]["all"]
        return s["current"], s["peak"], s["allocated"], s["freed"]

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats(self.device)


def phase_peak(before: Memory, after: Memory) -> tuple[int, bool]:
    """Peak allocated bytes of a phase from readings at its begin and end, and whether exact.

    Only the phase's own allocations and frees move the statistics between the readings
    (one thread launches the work; the allocator counts at launch time, on the host).
    With ``current`` c, high-water mark m, cumulative ``allocated`` a and ``freed`` f:

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
    if m1 > m0:
        return m1, True
    if c1 - c0 != (a1 - a0) - (f1 - f0):
        # The cumulative counters do not account for the change (an allocator backend
        # that does not keep them, such as cudaMallocAsync): only the mark bounds it.
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

    ``begin()`` returns a slot id (or -1 when all slots are in flight: ``dropped`` counts it
    and nothing blocks); ``end(slot)`` closes it; ``poll(slot)`` gives ``(gpu_ns,
    peak_bytes)`` once the GPU has passed the end event and frees the slot for reuse.
    ``peak_bytes`` is -1 with ``peak_memory="off"``. A slot whose measurement failed, and
    slot -1, poll as ``(-1, -1)``: resolved, not measured.
    """

    def __init__(self, backend: EventBackend, pool_size: int = 256,
                 peak_memory: str = "bound") -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        if peak_memory not in PEAK_MODES:
            raise ValueError(f"peak_memory must be one of {PEAK_MODES}, not {peak_memory!r}")
        self._backend = backend
        self.device_uuid: str = backend.device_uuid
        self.device_name: str = backend.device_name
        self.peak_memory = peak_memory
        self.dropped = 0  # measurements lost: pool dry, a device call failed, drain gave up
        self.inexact_peaks = 0  # phases whose peak_bytes is an upper bound (mode "bound")
        # Everything is allocated here, once: two events, a state and readings per slot.
        self._starts = [backend.new_event() for _ in range(pool_size)]
        self._ends = [backend.new_event() for _ in range(pool_size)]
        self._state = [_FREE] * pool_size
        self._before: list[Memory | None] = [None] * pool_size
        self._peak = [-1] * pool_size
        self._free = list(range(pool_size - 1, -1, -1))  # a stack: pop() gives slot 0 first
        self._record = backend.record
        self._query = backend.query
        self._read = None if peak_memory == "off" else backend.memory
        self._reset = backend.reset_peak if peak_memory == "reset" else None

    @property
    def pool_size(self) -> int:
        return len(self._state)

    @property
    def in_flight(self) -> int:
        """Slots begun and not yet resolved."""
        return len(self._state) - len(self._free)

    def begin(self) -> int:
        """Record a start event on the current stream; a slot id, or -1 when the pool is dry."""
        free = self._free
        if not free:
            self.dropped += 1
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
        try:
            self._record(self._ends[slot])  # event first, allocator after: see begin()
            if self._read is not None:
                after = self._read()
                if self._reset is not None:
                    # The reset at begin set the mark to the then-current allocation, so
                    # the mark now is this phase's peak.
                    self._peak[slot] = after[1]
                else:
                    peak, exact = phase_peak(self._before[slot], after)
                    self._peak[slot] = peak
                    if not exact:
                        self.inexact_peaks += 1
        except Exception:
            self.dropped += 1
            self._state[slot] = _FAILED
            return
        self._state[slot] = _ENDED

    def poll(self, slot: int) -> tuple[int, int] | None:
        """``(gpu_ns, peak_bytes)`` once the GPU has passed the end event, else None.

        Never waits (``Event.query()``). A resolved slot is released and may be handed out
        again by the next ``begin()``, so poll each slot until it resolves, once.
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
            self._release(slot)
            return round(ms * 1_000_000), self._peak[slot]
        if state == _FAILED:
            self._release(slot)
            return NOT_MEASURED
        return None  # begun, not ended: pending

    def drain(self, slots: Sequence[int], timeout_s: float) -> list[tuple[int, int] | None]:
        """At finish only: wait up to ``timeout_s`` for ``slots``, then give up on the rest.

        Training is over, so waiting is allowed here; it is bounded all the same, by
        polling ``Event.query()`` with short sleeps rather than ``Event.synchronize()``,
        which could hang on a wedged device. Slots whose ``end()`` never came, or that have
        not completed by the deadline, are released, counted in ``dropped`` and returned
        as None.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        out: list[tuple[int, int] | None] = [None] * len(slots)
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
            for i in pending:
                res = self.poll(slots[i])
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


def open_gpu_timer(pool_size: int = 256, backend: EventBackend | None = None,
                   peak_memory: str = "bound") -> GpuTimer | None:
    """A GpuTimer for the current CUDA device, or None when there is nothing to time.

    Without ``backend``: None unless the script has already imported torch (this function
    never imports it) and ``torch.cuda.is_initialized()``; on a CPU-only run that is the
    only ``torch.cuda`` call made. The Run calls this at loop starts and every 100 steps until it
    returns a timer. Never raises for a device problem: it returns None instead.
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
        return GpuTimer(TorchCudaBackend(torch), pool_size, peak_memory)
    except Exception:
        return None
