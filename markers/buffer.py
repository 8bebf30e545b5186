"""The markers' record buffer: wire slots in a preallocated array, sent in batches.

A phase writes three integers into ``slots`` at ``n`` (see ``markers.wire``) and calls
``flush`` once ``n`` reaches ``flush_at`` or its end time passes ``deadline_ns``; nothing
else happens per phase on a CPU. On a GPU a phase also reserves a GPU slot, filled once
its CUDA events have completed; ``flush`` sends only the slots before the first GPU slot
still pending, so records reach the sidecar in order, and never waits for the GPU.
"""

from __future__ import annotations

from array import array
from time import perf_counter_ns
from typing import Any

from markers import wire
from markers.transport import Sender

FLUSH_RECORDS = wire.FLUSH_SLOTS  # per message: ~6 KiB, the ~20 µs cost of a send spread thin
FLUSH_AGE_NS = 50_000_000  # and at least every 50 ms while phases keep ending
HELLO_EVERY_NS = 2_000_000_000  # re-announce the run so a restarted sidecar picks it up
GPU_DRAIN_S = 5.0  # the bounded wait for pending GPU times at finish
_SLOTS = wire.SLOT_WIDTH
_NO_GPU = wire.TAG_GPU | wire.FLAG_GPU_DROPPED << 16


class RecordBuffer:
    """Slots of one run waiting to be sent. One thread (the training loop's) uses it."""

    # Slots keep every attribute access of the hot path a specialized slot load, whatever
    # else the interpreter's caches hold (see docs/architecture.md, "The hot path").
    __slots__ = ("_context", "_contexts", "_next_hello_ns", "_pending", "deadline_ns",
                 "flush_at", "gpu", "hello", "n", "sender", "slots")

    def __init__(self, sender: Sender, hello: dict[str, Any], now_ns: int) -> None:
        self.sender = sender
        self.hello = hello
        self.gpu: Any = None  # markers.gpu.GpuTimer once the script uses CUDA
        self.flush_at = FLUSH_RECORDS * _SLOTS
        self.slots = array("q", bytes(8 * (self.flush_at + 4 * _SLOTS)))
        self.n = 0
        self.deadline_ns = now_ns + FLUSH_AGE_NS
        self._context = wire.context_slot(0, 0, -1, 0)
        self._contexts: list[int] = []  # offsets of the context slots in ``slots``
        self._pending: list[tuple[int, int]] = []  # (offset of a GPU slot, timer slot)
        self._next_hello_ns = now_ns + HELLO_EVERY_NS
        self._write_context()

    def set_context(self, flags: int, epoch: int, iteration: int, batch: int) -> None:
        """The context of the phases that follow (iteration boundaries, epoch ends)."""
        self._context = wire.context_slot(flags, epoch, iteration, batch)
        self._write_context()

    def _write_context(self) -> None:
        n = self.n
        contexts = self._contexts
        if contexts and contexts[-1] == n - _SLOTS:
            n -= _SLOTS  # nothing was recorded under the previous context: replace it
            contexts.pop()
        contexts.append(n)
        slots = self.slots
        slots[n], slots[n + 1], slots[n + 2] = self._context
        self.n = n + _SLOTS
        if len(slots) - self.n < 4 * _SLOTS:
            self._make_room()

    def record(self, phase_id: int, start_ns: int, end_ns: int) -> None:
        """Append one phase without GPU measurement (spans, data loading, loops)."""
        n = self.n
        slots = self.slots
        slots[n] = phase_id
        slots[n + 1] = start_ns
        slots[n + 2] = end_ns
        self.n = n = n + _SLOTS
        if n >= self.flush_at or end_ns >= self.deadline_ns:
            self.flush()

    def record_gpu(self, phase_id: int, start_ns: int, end_ns: int, timer_slot: int) -> None:
        """Append one phase and its GPU slot, pending until ``timer_slot`` resolves
        (-1: no measurement could be started, the slot says so at once)."""
        n = self.n
        self.slots[n:n + 2 * _SLOTS] = array(
            "q", (phase_id, start_ns, end_ns, _NO_GPU if timer_slot < 0 else wire.TAG_GPU,
                  -1, -1))
        if timer_slot >= 0:
            self._pending.append((n + _SLOTS, timer_slot))
        self.n = n + 2 * _SLOTS
        if self.n >= self.flush_at or end_ns >= self.deadline_ns:
            self.flush()

    def flush(self) -> None:
        """Send every slot whose GPU values are known; never waits, never raises."""
        now_ns = perf_counter_ns()
        self.deadline_ns = now_ns + FLUSH_AGE_NS
        ready = self._resolve_gpu()
        if ready:
            count = self._phase_count(ready)
            if count:
                self.sender.send_records(self.slots[:ready], count)
            self._keep_from(ready)
        if now_ns >= self._next_hello_ns:
            self._next_hello_ns = now_ns + HELLO_EVERY_NS
            self.sender.send_control({**self.hello, "repeat": True})
        self._make_room()

    def drain_gpu(self) -> None:
        """At finish only: wait (bounded, ``GPU_DRAIN_S``) for the GPU values still
        pending; the ones that never come are marked not measured."""
        if not self._pending:
            return
        results = self.gpu.drain([slot for _, slot in self._pending], timeout_s=GPU_DRAIN_S)
        for (offset, _), result in zip(self._pending, results, strict=True):
            gpu_ns, peak = result if result is not None else (-1, -1)
            self.slots[offset:offset + _SLOTS] = array(
                "q", (wire.TAG_GPU if gpu_ns >= 0 else _NO_GPU, gpu_ns, peak))
        self._pending = []

    # -- internals ------------------------------------------------------------------

    def _resolve_gpu(self) -> int:
        """Fill in resolved GPU slots; the offset up to which ``slots`` can be sent."""
        resolved = 0
        for offset, timer_slot in self._pending:
            result = self.gpu.poll(timer_slot)
            if result is None:
                break
            self.slots[offset + 1], self.slots[offset + 2] = result
            resolved += 1
        # Stop before the phase slot of the first GPU slot still pending.
        ready = self._pending[resolved][0] - _SLOTS if resolved < len(self._pending) else self.n
        del self._pending[:resolved]
        return ready

    def _phase_count(self, end: int) -> int:
        if self.gpu is None:  # no GPU slots: everything but the context slots
            return (end - _SLOTS * sum(1 for c in self._contexts if c < end)) // _SLOTS
        slots = self.slots
        return sum(1 for i in range(0, end, _SLOTS) if slots[i] & wire.TAG_MASK < wire.TAG_GPU)

    def _keep_from(self, ready: int) -> None:
        """Drop the sent slots; the rest starts after the context it was recorded under."""
        context_at = max(c for c in self._contexts if c < ready)  # slot 0 is one
        kept = self.slots[context_at:context_at + _SLOTS] + self.slots[ready:self.n]
        shift = ready - _SLOTS
        self.slots[:len(kept)] = kept
        self.n = len(kept)
        self._contexts = [0] + [c - shift for c in self._contexts if c > ready]
        self._pending = [(offset - shift, slot) for offset, slot in self._pending]

    def _make_room(self) -> None:
        """Keep space for two more phases with GPU slots (the array only grows while GPU
        results hold the queue back; the event pool bounds that)."""
        if len(self.slots) - self.n < 4 * _SLOTS:
            self.slots.extend(array("q", bytes(8 * self.flush_at)))
