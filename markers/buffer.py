"""The markers' record buffer: wire slots in a preallocated array, sent in batches.

A phase packs one slot (three integers) into ``slots`` at ``n`` (see ``markers.wire``)
and calls ``flush`` once ``n`` reaches ``flush_at`` or its end time passes ``deadline_ns``; nothing
else happens per phase on a CPU. On a GPU a phase also reserves a GPU slot, filled once
its CUDA events have completed (GPU time, peak, and the GPU start's lag behind the host
start); ``flush`` sends only the slots before the first GPU slot still pending, so
records reach the sidecar in order, and never waits for the GPU nor queries it during a
CUDA graph capture.

Custom phase declarations go out before any records message that follows them; one that
cannot be queued is retried at each flush, and records are not sent ahead of it (they
would name an id the sidecar does not know). The declarations also ride in every
repeated hello, so a sidecar that takes over a running process learns them all.

In a forked child (a DataLoader worker) the buffer cannot send: it counts its phases
instead (``markers.forks``) and the parent reports the total.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from time import perf_counter_ns
from typing import Any

from markers import wire
from markers.forks import ChildCounts
from markers.transport import Sender

FLUSH_RECORDS = wire.FLUSH_SLOTS  # per message: ~24 KiB, the ~20 µs cost of a send spread thin
# With GPU timing each phase holds an event pair of the timer's pool (256) until a flush
# polls it: flush sooner so the pool never runs dry between flushes.
GPU_FLUSH_RECORDS = 256
FLUSH_AGE_NS = 250_000_000  # and at least every 250 ms while phases keep ending
HELLO_EVERY_NS = 2_000_000_000  # re-announce the run so a restarted sidecar picks it up
GPU_DRAIN_S = 5.0  # the bounded wait for pending GPU times at finish
_SLOTS = wire.SLOT_WIDTH
# (slots, byte offset, tag, a, b): one C call writes a slot, cheaper than three
# subscripted stores; the hot path of ``markers.run.Phase`` uses it too.
pack_slot = wire.SLOT.pack_into
_NO_GPU = wire.TAG_GPU | wire.FLAG_GPU_DROPPED << 16
_NOT_MEASURED = (-1, -1, 0)


class RecordBuffer:
    """Slots of one run waiting to be sent. One thread (the training loop's) uses it."""

    # Slots keep every attribute access of the hot path a specialized slot load, whatever
    # else the interpreter's caches hold (see docs/architecture.md, "The hot path").
    __slots__ = (
        "_contexts",
        "_next_hello_ns",
        "_pending",
        "_sent_since_context",
        "_undeclared",
        "children",
        "deadline_ns",
        "flush_at",
        "flushes",
        "gpu",
        "gpu_unfinished",
        "hello",
        "in_child",
        "n",
        "sender",
        "slots",
    )

    def __init__(self, sender: Sender, hello: dict[str, Any], now_ns: int) -> None:
        self.sender = sender
        self.hello = hello
        self.gpu: Any = None  # markers.gpu.GpuTimer once the script uses CUDA
        self.gpu_unfinished = 0  # phases whose GPU time had not come when drain_gpu gave up
        self.flush_at = FLUSH_RECORDS * _SLOTS
        self.slots = array("q", bytes(8 * (self.flush_at + 4 * _SLOTS)))
        self.n = 0
        self.deadline_ns = now_ns + FLUSH_AGE_NS
        self._contexts: list[int] = []  # offsets of the context slots in ``slots``, ascending
        self._pending: list[tuple[int, int]] = []  # (offset of a GPU slot, timer slot)
        self._next_hello_ns = now_ns + HELLO_EVERY_NS
        self._undeclared: list[dict[str, Any]] = []  # phase declarations not queued yet
        self._sent_since_context = False  # records of the current context already sent
        self.children = ChildCounts()
        self.flushes = 0  # with ``n``: tells whether anything was recorded since a moment
        self.in_child = False  # this copy lives in a forked child: count, never send
        self.set_context(0, 0, -1, 0)

    def declare(self, phase_id: int, name: str) -> None:
        """Declare custom phase ``name`` as ``phase_id`` to the sidecar (now if it can be
        queued, else before the next records) and in every repeated hello."""
        self.hello.setdefault("phases", {})[name] = phase_id
        self._undeclared.append({"type": wire.PHASE, "id": phase_id, "name": name})
        self._send_declarations()

    def _send_declarations(self) -> bool:
        while self._undeclared:
            if not self.sender.send_control(self._undeclared[0]):
                return False
            del self._undeclared[0]
        return True

    def use_gpu(self, timer: Any) -> None:
        """From now on phases carry GPU slots timed by ``timer`` (``markers.gpu.GpuTimer``);
        what was recorded before is sent first, as it has none."""
        self.flush()
        self.gpu = timer
        self.flush_at = GPU_FLUSH_RECORDS * _SLOTS

    def recorded_since_context(self) -> bool:
        """Whether any phase was recorded since the last ``set_context``."""
        return self._sent_since_context or self.n > self._contexts[-1] + _SLOTS

    def set_context(self, flags: int, epoch: int, iteration: int, batch: int) -> None:
        """The context of the phases that follow (iteration boundaries, epoch ends)."""
        context = wire.context_slot(flags, epoch, iteration, batch)
        n = self.n
        contexts = self._contexts
        if contexts and contexts[-1] == n - _SLOTS:
            n -= _SLOTS  # nothing was recorded under the previous context: replace it
            contexts.pop()
        self._sent_since_context = False
        contexts.append(n)
        slots = self.slots
        pack_slot(slots, n << 3, *context)
        self.n = n + _SLOTS
        if len(slots) - self.n < 4 * _SLOTS:
            self._make_room()

    def record(self, phase_id: int, start_ns: int, end_ns: int) -> None:
        """Append one phase without GPU measurement (spans, data loading, loops)."""
        n = self.n
        pack_slot(self.slots, n << 3, phase_id, start_ns, end_ns)
        self.n = n = n + _SLOTS
        if n >= self.flush_at or end_ns >= self.deadline_ns:
            self.flush()

    def record_and_context(
        self, tag: int, start_ns: int, end_ns: int, context: tuple[int, int, int, int]
    ) -> None:
        """``record`` one slot, then ``set_context(*context)``, where ``context`` differs
        from the current one in its iteration and batch only: an iteration's loop record
        and the context of the next, once a step of a loop driver. Packed here when
        neither would flush nor grow the array (the slot just recorded keeps the context
        before it from being replaced), the context's tag copied from the current
        context slot; else those two do it."""
        n = self.n
        if n + 2 * _SLOTS > self.flush_at or end_ns >= self.deadline_ns:
            self.record(tag, start_ns, end_ns)
            self.set_context(*context)
            return
        slots = self.slots
        contexts = self._contexts
        pack_slot(slots, n << 3, tag, start_ns, end_ns)
        n += _SLOTS
        pack_slot(slots, n << 3, slots[contexts[-1]], context[2], context[3])
        contexts.append(n)
        self._sent_since_context = False
        self.n = n + _SLOTS

    def record_gpu(self, phase_id: int, start_ns: int, end_ns: int, timer_slot: int) -> None:
        """Append one phase and its GPU slot, pending until ``timer_slot`` resolves
        (-1: no measurement could be started, the slot says so at once)."""
        n = self.n
        self.slots[n : n + 2 * _SLOTS] = array(
            "q", (phase_id, start_ns, end_ns, _NO_GPU if timer_slot < 0 else wire.TAG_GPU, -1, -1)
        )
        if timer_slot >= 0:
            self._pending.append((n + _SLOTS, timer_slot))
        self.n = n + 2 * _SLOTS
        if self.n >= self.flush_at or end_ns >= self.deadline_ns:
            self.flush()

    def flush(self) -> None:
        """Send every slot whose GPU values are known; never waits, never raises."""
        if self.in_child:
            self.children.report(self._phase_count(self.n))
            self._keep_from(self.n)
            return  # deadline stays 0: a child reports at every phase (it may end any time)
        self.flushes += 1
        now_ns = perf_counter_ns()
        self.deadline_ns = now_ns + FLUSH_AGE_NS
        ready = self._resolve_gpu()
        if ready:
            count = self._phase_count(ready)
            if count:
                if self._send_declarations():
                    self.sender.send_records(self.slots[:ready], count)
                else:  # the queue is full: the records could not go either
                    self.sender.dropped += count
                if self._contexts[-1] < ready - _SLOTS:
                    self._sent_since_context = True
            self._keep_from(ready)
        if self.children.collect():
            self.hello["worker_phases"] = self.children.total
        if now_ns >= self._next_hello_ns:
            self._next_hello_ns = now_ns + HELLO_EVERY_NS
            self.sender.send_control({**self.hello, "repeat": True})
        self._make_room()

    def drain_gpu(self) -> None:
        """At finish only: wait (bounded, ``GPU_DRAIN_S``) for the GPU values still
        pending; the ones that never come are marked not measured and counted in
        ``gpu_unfinished`` (the GPU was still that far behind when the loop ended)."""
        if not self._pending:
            return
        slots = self.slots
        results = self.gpu.drain(
            [slot for _, slot in self._pending],
            timeout_s=GPU_DRAIN_S,
            host_starts=[slots[o - 2] for o, _ in self._pending],
        )
        for (offset, _), result in zip(self._pending, results, strict=True):
            self._fill_gpu(offset, result if result is not None else _NOT_MEASURED)
        self.gpu_unfinished += sum(result is None for result in results)
        self._pending = []

    def enter_child(self) -> None:
        """In a forked child: forget the parent's unsent records and GPU timing; from now on
        every phase is counted and reported to the parent at once.

        The parent's GPU timer is kept alive for the child's whole life, past interpreter
        shutdown: freeing it would run its CUDA events' destructors (a device switch and
        ``cudaEventDestroy``), which fail in a forked child ("CUDA warning:
        initialization error", or a DataLoader worker killed)."""
        if self.gpu is not None:
            _keep_forever(self.gpu)
        self.gpu = None
        self._pending = []
        self._undeclared = []
        self.children.in_child()
        self.in_child = True
        self.n = 0
        self._contexts = []
        self.set_context(0, 0, -1, 0)  # a child counts phases: no context is ever sent
        self.deadline_ns = 0

    def _fill_gpu(self, offset: int, result: tuple[int, int, int]) -> None:
        gpu_ns, peak, lag_ns = result
        slots = self.slots
        slots[offset] = wire.gpu_tag(lag_ns) if gpu_ns >= 0 else _NO_GPU
        slots[offset + 1] = gpu_ns
        slots[offset + 2] = peak

    # -- internals ------------------------------------------------------------------

    def _resolve_gpu(self) -> int:
        """Fill in resolved GPU slots; the offset up to which ``slots`` can be sent."""
        resolved = 0
        gpu = self.gpu
        # Inside a CUDA graph capture an event query would make the capture fail: wait.
        pending = self._pending if gpu is None or not gpu.capturing() else []
        slots = self.slots
        for offset, timer_slot in pending:
            result = gpu.poll(timer_slot, slots[offset - 2])  # the phase slot's start
            if result is None:
                break
            self._fill_gpu(offset, result)
            resolved += 1
        # Stop before the phase slot of the first GPU slot still pending.
        ready = self._pending[resolved][0] - _SLOTS if resolved < len(self._pending) else self.n
        del self._pending[:resolved]
        return ready

    def _phase_count(self, end: int) -> int:
        if self.gpu is None:  # no GPU slots: everything but the context slots
            return (end - _SLOTS * bisect_left(self._contexts, end)) // _SLOTS
        slots = self.slots
        return sum(1 for i in range(0, end, _SLOTS) if slots[i] & wire.TAG_MASK < wire.TAG_GPU)

    def _keep_from(self, ready: int) -> None:
        """Drop the sent slots; the rest starts after the context it was recorded under."""
        contexts = self._contexts
        before = bisect_left(contexts, ready)  # the contexts below ``ready``; slot 0 is one
        context_at = contexts[before - 1]
        kept = self.slots[context_at : context_at + _SLOTS] + self.slots[ready : self.n]
        shift = ready - _SLOTS
        self.slots[: len(kept)] = kept
        self.n = len(kept)
        self._contexts = [0] + [c - shift for c in contexts[before:] if c > ready]
        self._pending = [(offset - shift, slot) for offset, slot in self._pending]

    def _make_room(self) -> None:
        """Keep space for two more phases with GPU slots (the array only grows while GPU
        results hold the queue back; the event pool bounds that)."""
        if len(self.slots) - self.n < 4 * _SLOTS:
            self.slots.extend(array("q", bytes(8 * self.flush_at)))


def _keep_forever(obj: Any) -> None:
    """Hold one more reference to ``obj`` that nothing ever releases: not the collector,
    not the clearing of modules at interpreter shutdown (a plain module-level list would
    be cleared there, and the objects freed)."""
    import ctypes  # only in a forked child that inherited a GPU timer

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
