"""A monitored run: phase stamps into a preallocated buffer, shipped in batches.

The hot path (a phase's enter and exit) is two ``perf_counter_ns`` calls, one
``array.extend`` of nine integers and one comparison; the buffer goes out as one message
every ``FLUSH_RECORDS`` records or ``FLUSH_AGE_NS``, whichever comes first, and at epoch
ends, checkpoints and finish. Nothing here waits on the GPU or raises into the loop.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from markers import wire
from markers.transport import Sender

perf_counter_ns = time.perf_counter_ns

FLUSH_RECORDS = 64
FLUSH_AGE_NS = 50_000_000
HELLO_EVERY_NS = 2_000_000_000  # re-announce the run so a restarted sidecar can pick it up
FINISH_TIMEOUT_S = 10.0
CHECKPOINT_TIMEOUT_S = 5.0
STATE_TIMEOUT_S = 5.0

GPU_INDEX = wire.FIELD_INDEX["gpu_ns"]
PEAK_INDEX = wire.FIELD_INDEX["peak_bytes"]
FLAGS_INDEX = wire.FIELD_INDEX["flags"]

F = TypeVar("F", bound=Callable[..., Any])


def _batch_size(batch: Any) -> int | None:
    """First dimension of a batch (a tensor, or the first tensor of a tuple/list/dict)."""
    for _ in range(3):
        shape = getattr(batch, "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else None
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return None
    return None


class Phase:
    """A reusable phase marker: ``with run.phase("forward"):`` or ``@run.phase("x")``."""

    __slots__ = ("_id", "_run", "_slots", "_starts")

    def __init__(self, run: Run, phase_id: int) -> None:
        self._run = run
        self._id = phase_id
        self._starts: list[int] = []  # a stack, so the same phase may nest or recurse
        self._slots: list[int] = []

    def __enter__(self) -> Phase:
        gpu = self._run._gpu
        if gpu is not None:
            self._slots.append(gpu.begin())
        self._starts.append(perf_counter_ns())
        return self

    def __exit__(self, *exc_info: object) -> None:
        end_ns = perf_counter_ns()
        run = self._run
        slot = -1
        if run._gpu is not None and self._slots:
            slot = self._slots.pop()
            run._gpu.end(slot)
        run._add(self._id, self._starts.pop(), end_ns, slot)

    def __call__(self, function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _Span:
    """A context manager that stamps one uncapped phase (Epoch, Validation)."""

    __slots__ = ("_id", "_on_exit", "_run", "_start_ns")

    def __init__(self, run: Run, phase_id: int, on_exit: Callable[[], None]) -> None:
        self._run, self._id, self._on_exit = run, phase_id, on_exit
        self._start_ns = 0

    def __enter__(self) -> _Span:
        self._start_ns = perf_counter_ns()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._run._add(self._id, self._start_ns, perf_counter_ns(), -1)
        self._on_exit()


class Run:
    """One monitored training run of one split (created by ``markers.start_run``)."""

    def __init__(self, sender: Sender, hello: dict[str, Any], monitored: bool,
                 on_close: Callable[[], None] | None = None, first_epoch: int = 0) -> None:
        self._sender = sender
        self.monitored = monitored
        self._hello = hello
        self._on_close = on_close
        self._accumulation = int(hello["accumulation_steps"])
        self._buffer = array("q")
        self._count = 0
        self._pending: list[tuple[int, int]] = []  # (record index, GPU slot), in order
        self._deadline_ns = 0
        self._next_hello_ns = perf_counter_ns() + HELLO_EVERY_NS
        self._gpu: Any = None  # markers.gpu.GpuTimer once CUDA is in use
        self._phases: dict[str, Phase] = {}
        self._next_custom = wire.FIRST_CUSTOM_ID
        self._epoch = first_epoch  # epochs continue across resumes
        self._iteration = -1  # the record field: current training or validation iteration
        self._train_iteration = 0
        self._val_iteration = 0
        self._batch_gate = 0  # network batches before the current iteration began
        self._net_batches = 0
        self._flags = 0
        self._batch_sizes_sent: set[str] = set()
        self._finished = False
        self.start_ns = int(hello["start_ns"])

    # -- public API -----------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Records that could not be sent so far (sidecar absent or slow)."""
        return self._sender.dropped

    def phase(self, name: str) -> Phase:
        """The marker of phase ``name``: a canonical one (forward, backward, optimization,
        evaluation, metrics) or a custom name, which gets its own column.
        Use as a context manager or a decorator; the same object is returned each time.
        """
        marker = self._phases.get(name)
        if marker is None:
            phase_id = wire.CANONICAL_PHASE_NAMES.get(name)
            if phase_id is None:
                phase_id = self._next_custom
                self._next_custom += 1
                self._control({"type": "phase", "id": phase_id, "name": name})
            marker = self._phases[name] = Phase(self, phase_id)
        return marker

    def epoch(self) -> _Span:
        """Context manager around one epoch (the Epoch column)."""
        return _Span(self, wire.EPOCH, self._end_epoch)

    def validation(self) -> _Span:
        """Context manager around one validation pass (the Validation column)."""
        return _Span(self, wire.VALIDATION, self.flush)

    def train_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the batches of ``loader``, stamping Training data loading and Training loop;
        one Training loop measurement spans ``accumulation_steps`` batches.
        """
        return self._batches(loader, validation=False)

    def val_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the batches of ``loader``, stamping Validation data loading and loop."""
        return self._batches(loader, validation=True)

    def checkpoint(self, timeout_s: float = CHECKPOINT_TIMEOUT_S) -> bool:
        """Send what is buffered and have the sidecar write every file and its state now.

        Waits for the sidecar's answer at most ``timeout_s``; True when it wrote.
        """
        self.flush()
        reply = self._request({"type": "checkpoint"}, timeout_s)
        return bool(reply and reply.get("ok"))

    def state_dict(self, timeout_s: float = STATE_TIMEOUT_S) -> dict[str, Any]:
        """The sidecar's state of this split, to keep inside the user's own checkpoint.

        The same content as the state file ``checkpoint()`` writes (a JSON-compatible dict
        with a ``schema`` key). Waits for the sidecar at most ``timeout_s`` seconds; returns
        an empty dict when the run is not monitored or no sidecar answered (loading an
        empty dict later is a no-op). Never raises.
        """
        self.flush()
        reply = self._request({"type": "state"}, timeout_s)
        state = reply.get("state") if reply and reply.get("ok") else None
        return state if isinstance(state, dict) else {}

    def load_state_dict(self, state: dict[str, Any],
                        timeout_s: float = STATE_TIMEOUT_S) -> bool:
        """Continue this split from ``state`` (from ``state_dict()`` of an earlier process):
        the same as ``start_run(resume=True)`` with the state kept by the user. Call it
        before the first epoch. Epochs continue from the saved ones. Waits at most
        ``timeout_s`` seconds; True when the sidecar took the state, False (with one
        RuntimeWarning giving the sidecar's reason) otherwise. Never raises.
        """
        if not state:
            return False
        self.flush()
        reply = self._request({"type": "load_state", "state": state}, timeout_s)
        if not (reply and reply.get("ok")):
            reason = reply.get("error") if reply else "no answer from the sidecar"
            warnings.warn(f"markers: saved state not loaded ({reason})", RuntimeWarning,
                          stacklevel=2)
            return False
        epoch = reply.get("epoch")
        if isinstance(epoch, int):
            self._epoch = epoch
        return True

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        """End the run: send everything, have the sidecar write its files (waits for it at
        most ``FINISH_TIMEOUT_S``), close the connection. Safe to call more than once.
        """
        if self._finished:
            return
        self._finished = True
        end_ns = perf_counter_ns()
        self._drain_gpu()
        self.flush()
        reply = self._request({"type": "finish", "status": status, "error": error,
                               "end_ns": end_ns}, FINISH_TIMEOUT_S)
        if reply is None:
            reason = (f"within {FINISH_TIMEOUT_S:.0f} s" if self._sender.connected
                      else "(no sidecar connected)")
            warnings.warn(f"markers: the sidecar did not confirm writing the files {reason}",
                          RuntimeWarning, stacklevel=2)
        self._sender.close()
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 _tb: object) -> None:
        if exc_type is None:
            self.finish("completed")
        else:
            self.finish("failed", f"{exc_type.__name__}: {exc}")

    # -- iterations -----------------------------------------------------------------

    def _batches(self, loader: Iterable[Any], validation: bool) -> Iterator[Any]:
        loading = wire.VALIDATION_DATA_LOADING if validation else wire.TRAINING_DATA_LOADING
        flags = wire.FLAG_IN_ITERATION | (wire.FLAG_VALIDATION if validation else 0)
        per_iteration = 1 if validation else self._accumulation
        kind = "validation" if validation else "train"
        iterator = iter(loader)
        in_iteration = 0
        iteration_start_ns = 0
        try:
            while True:
                start_ns = perf_counter_ns()
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                if in_iteration == 0:
                    iteration_start_ns = start_ns
                    self._begin_iteration(validation, flags)
                self._add(loading, start_ns, perf_counter_ns(), -1)
                if kind not in self._batch_sizes_sent:
                    self._send_batch_size(kind, batch)
                yield batch
                self._net_batches += 1
                in_iteration += 1
                if in_iteration == per_iteration:
                    self._end_iteration(validation, iteration_start_ns)
                    in_iteration = 0
            if in_iteration:  # the last, shorter accumulation step of the epoch
                self._end_iteration(validation, iteration_start_ns)
        finally:
            self._flags = 0  # a loop left early leaves its iteration open: never measured
            self._iteration = -1

    def _begin_iteration(self, validation: bool, flags: int) -> None:
        self._flags = flags
        self._batch_gate = self._net_batches
        self._iteration = self._val_iteration if validation else self._train_iteration
        if self._gpu is None:
            self._open_gpu()

    def _end_iteration(self, validation: bool, start_ns: int) -> None:
        self._add(wire.VALIDATION_LOOP if validation else wire.TRAINING_LOOP, start_ns,
                  perf_counter_ns(), -1)
        if validation:
            self._val_iteration += 1
        else:
            self._train_iteration += 1

    def _end_epoch(self) -> None:
        self._epoch += 1
        self.flush()

    def _send_batch_size(self, kind: str, batch: Any) -> None:
        self._batch_sizes_sent.add(kind)
        size = _batch_size(batch)
        if size:
            self._control({"type": "batch_size", "kind": kind, "value": size})

    # -- buffer and transport ---------------------------------------------------------

    def _add(self, phase_id: int, start_ns: int, end_ns: int, slot: int) -> None:
        self._buffer.extend((phase_id, self._flags, self._epoch, self._iteration,
                             self._batch_gate, start_ns, end_ns, -1, -1))
        if slot >= 0:
            self._pending.append((self._count, slot))
        self._count += 1
        if self._count >= FLUSH_RECORDS or end_ns >= self._deadline_ns:
            self.flush()

    def flush(self) -> None:
        """Send the buffered records whose GPU times are known; never waits."""
        now_ns = perf_counter_ns()
        self._deadline_ns = now_ns + FLUSH_AGE_NS
        sendable = self._resolve_gpu()
        if sendable:
            width = wire.RECORD_WIDTH
            if sendable == self._count:
                self._sender.send_records(self._buffer, sendable)
                self._buffer = array("q")
            else:
                self._sender.send_records(self._buffer[:sendable * width], sendable)
                del self._buffer[:sendable * width]
            if now_ns >= self._next_hello_ns:
                self._next_hello_ns = now_ns + HELLO_EVERY_NS
                self._sender.send_control({**self._hello, "repeat": True})
        self._count -= sendable
        if self._pending and sendable:
            self._pending = [(index - sendable, slot) for index, slot in self._pending]

    def _resolve_gpu(self) -> int:
        """Fill in resolved GPU values; the number of leading records ready to send."""
        if not self._pending:
            return self._count
        resolved = 0
        for index, slot in self._pending:
            result = self._gpu.poll(slot)
            if result is None:
                break
            base = index * wire.RECORD_WIDTH
            self._buffer[base + GPU_INDEX], self._buffer[base + PEAK_INDEX] = result
            resolved += 1
        ready = self._pending[resolved][0] if resolved < len(self._pending) else self._count
        del self._pending[:resolved]
        return ready

    def _drain_gpu(self) -> None:
        """At finish only: wait (bounded) for the GPU values still pending."""
        if not self._pending:
            return
        results = self._gpu.drain([slot for _, slot in self._pending], timeout_s=5.0)
        for (index, _), result in zip(self._pending, results, strict=True):
            base = index * wire.RECORD_WIDTH
            if result is None:
                self._buffer[base + FLAGS_INDEX] |= wire.FLAG_GPU_DROPPED
            else:
                self._buffer[base + GPU_INDEX], self._buffer[base + PEAK_INDEX] = result
        self._pending = []

    def _open_gpu(self) -> None:
        """Start GPU timing once the script uses CUDA (checked at iteration starts)."""
        if "torch" not in sys.modules:
            return
        from markers.gpu import open_gpu_timer

        timer = open_gpu_timer()
        if timer is not None:
            self._gpu = timer
            self._control({"type": "gpu", "uuid": timer.device_uuid,
                           "name": timer.device_name})

    def _control(self, body: dict[str, Any]) -> None:
        self._sender.send_control(body)

    def _request(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        return self._sender.request(body, timeout_s)

    def close_at_exit(self) -> None:
        """At interpreter exit: a run left open is finished (failed after an uncaught
        exception, which the interpreter records in ``sys.last_value``)."""
        if not self._finished:
            last = getattr(sys, "last_value", None)
            self.finish("failed" if last is not None else "completed",
                        repr(last) if last is not None else None)
