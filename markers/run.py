"""A monitored run: the phases, epochs and iterations of one split.

The hot path (a phase's enter and exit on a CPU) is two ``perf_counter_ns`` calls, one
slot packed into the preallocated ``markers.buffer.RecordBuffer`` and one comparison; the
buffer goes out as one message every ``FLUSH_RECORDS`` records or ``FLUSH_AGE_NS``,
whichever comes first, and at epoch ends, checkpoints and finish. Iteration boundaries
write a context slot (epoch, iteration, warmup gate) that the phases after it share.
Nothing here waits on the GPU or raises into the loop. The iteration model every loop
shape follows is described in docs/iteration-model.md.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from markers import forks, wire
from markers.buffer import RecordBuffer, pack_slot
from markers.loaders import loader_control
from markers.transport import Sender

perf_counter_ns = time.perf_counter_ns

FINISH_TIMEOUT_S = 10.0
CHECKPOINT_TIMEOUT_S = 5.0
STATE_TIMEOUT_S = 5.0
GPU_CHECK_EVERY = 100  # steps between checks whether the script started using CUDA

F = TypeVar("F", bound=Callable[..., Any])


def _first_dims(batch: Any, depth: int = 3) -> set[int] | None:
    """The first dimensions found in ``batch``: a tensor's (anything with ``shape``), those
    of the fields of a tuple, a default-collated list or a mapping (``(inputs, labels)``,
    ``{"input_ids": ...}``), the length of a list of strings or numbers. None when it cannot
    tell: a list of samples as they are (a list of tuples, dicts or token lists, as an
    identity ``collate_fn`` gives), or an object without a shape.
    """
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return {int(shape[0])} if len(shape) else set()
    if batch is None or isinstance(batch, (str, bytes, int, float)):
        return set()
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
        texts = all(isinstance(item, str) for item in items)
        scalars = isinstance(batch, list) and all(isinstance(i, (int, float)) for i in items)
        if items and (texts or scalars):
            return {len(items)}  # texts, or scalar samples
        if isinstance(batch, list) and items and all(
                isinstance(item, (list, tuple, Mapping)) for item in items):
            return None  # samples, not fields: the batch size is ambiguous
    else:
        return None
    if depth == 0:
        return None
    sizes: set[int] = set()
    for item in items:
        found = _first_dims(item, depth - 1)
        if found is None:
            return None
        sizes |= found
    return sizes


def _batch_size(batch: Any) -> int | None:
    """The batch size of ``batch`` where it is unambiguous (see ``_first_dims``: every
    first dimension found agrees), else None."""
    sizes = _first_dims(batch)
    return sizes.pop() if sizes and len(sizes) == 1 else None


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, or ``Type`` alone when it has no message (a
    KeyboardInterrupt): the cause a failed run's files give."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Phase:
    """A reusable phase marker: ``with run.phase("forward"):`` or ``@run.phase("x")``.

    ``__exit__`` packs three integers into the buffer inline and compares once: it runs
    at every phase of every step. Once the script uses CUDA the Run turns its markers into
    ``GpuPhase`` (same slots), so the CPU path carries no GPU test. A phase entered again
    inside itself (a decorated helper called within the same phase) is one measurement,
    the outer one: the inner entries only count their depth.
    """

    __slots__ = ("_buffer", "_depth", "_id", "_slot", "_start")

    def __init__(self, buffer: RecordBuffer, phase_id: int) -> None:
        self._buffer = buffer
        self._id = phase_id
        self._start = 0  # 0: not entered
        self._slot = -1  # the GPU timer slot of the current entry (GpuPhase)
        self._depth = 0  # entries inside the open one

    def __enter__(self) -> Phase:
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

    def __call__(self, function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class GpuPhase(Phase):
    """A phase marker that also records CUDA events (``markers.gpu``); never waits."""

    __slots__ = ()

    def __enter__(self) -> Phase:
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


class _Span:
    """A context manager over a begin/end pair of ``Run`` primitives (epoch, validation);
    an exception leaving it ends the span as cut short (``failed``)."""

    __slots__ = ("_begin", "_end")

    def __init__(self, begin: Callable[[], None], end: Callable[[bool], None]) -> None:
        self._begin, self._end = begin, end

    def __enter__(self) -> _Span:
        self._begin()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self._end(exc_type is not None)


class _Iteration:
    """An iteration begun and not yet ended: where it started, its context slot, the
    batches it held and the time it was suspended (a validation inside it)."""

    __slots__ = ("batches", "context", "excluded_ns", "recorded", "start_ns", "validation")

    def __init__(self, validation: bool, start_ns: int,
                 context: tuple[int, int, int, int]) -> None:
        self.validation = validation
        self.start_ns = start_ns
        self.context = context  # (flags, epoch, iteration, batch)
        self.batches = 0
        self.excluded_ns = 0
        self.recorded = False  # phases recorded in it before a suspension


class _PhaseTable(dict[str, "Phase | _NullPhase"]):
    """The phase markers of a run by name; a name seen for the first time gets its marker
    from ``make`` (``__missing__``), later lookups are plain dict hits."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[str], Phase | _NullPhase]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, name: str) -> Phase | _NullPhase:
        marker = self[name] = self._make(name)
        return marker


class Run:
    """One monitored training run of one split (created by ``markers.start_run``).

    The iteration model (SPEC §4, docs/iteration-model.md) lives in the primitives: an
    iteration runs from fetching its batch to fetching the next (or leaving the loop);
    every iteration that holds anything ends with exactly one loop record, complete or
    flagged incomplete, so nothing of it can move into a later one.

    ``run.phase(name)`` returns the marker of phase ``name``: a canonical one (forward,
    backward, optimization, evaluation, metrics) or a custom name, which gets its own
    column (tabs and newlines in it become spaces). A custom name equal to a standard
    label in any case (``Forward``, ``Epoch``, ``Training loop``, ...) is refused with one
    RuntimeWarning and measures nothing. Use it as a context manager or a decorator; the
    same object is returned each time.
    """

    def __init__(self, sender: Sender, hello: dict[str, Any], monitored: bool,
                 on_close: Callable[[], None] | None = None, first_epoch: int = 0,
                 device: Any = None) -> None:
        self._sender = sender
        self._device = device  # start_run's device=: what GPU timing should time
        self.monitored = monitored
        self.out_dir: Path | None = None  # the run folder as the sidecar resolved it
        self._on_close = on_close
        self._accumulation = int(hello["accumulation_steps"])
        # Batch sizes read from the batches (by ``validation``): the last one sent (0: the
        # batches cannot tell), None before the first batch, -1 when given (not read).
        self._read_sizes: list[int | None] = [None if hello.get(key) is None else -1
                                              for key in ("train_batch_size", "val_batch_size")]
        self._sized = [-1, -1]  # the iteration whose size was read last (by ``validation``)
        self._buffer = RecordBuffer(sender, hello, perf_counter_ns())
        self._phases = _PhaseTable(self._new_phase)
        # run.phase(name) is written inside the loop, so it is the table's own C lookup
        # (no Python frame): a known name costs a dict hit, a new one calls _new_phase
        # (a refused name is kept too, as the null marker, so it warns once).
        self.phase: Callable[[str], Phase | _NullPhase] = self._phases.__getitem__
        self._next_custom = wire.FIRST_CUSTOM_ID
        self._epoch = first_epoch  # epochs continue across resumes
        self._epoch_start_ns = 0  # 0: no epoch open
        self._validation_start_ns = 0  # 0: no validation pass open
        self._boundary_ns = 0  # the latest begin or end of an epoch or validation pass
        self._iterations = [0, 0]  # training, validation iterations so far (by `validation`)
        self._net_batches = 0  # batches that went through the network in this process
        self._open: _Iteration | None = None
        self._suspended: tuple[_Iteration, int] | None = None  # (iteration, since ns)
        self._left: list[tuple[_Iteration, int]] = []  # loops left: (iteration, end ns)
        self._context = (0, self._epoch, -1, 0)
        self._finished = False
        self._buffer.set_context(*self._context)
        forks.on_fork(self, Run._before_fork, Run._enter_child)

    # -- public API -----------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Records that could not be sent so far (sidecar absent or slow)."""
        return self._sender.dropped

    def epoch(self) -> _Span:
        """Context manager around one epoch (the Epoch column); an exception leaving it
        keeps the epoch in phases.tsv flagged incomplete."""
        return _Span(self.begin_epoch, self.end_epoch)

    def validation(self) -> _Span:
        """Context manager around one validation pass (the Validation column). Inside a
        training iteration it suspends that iteration: its Training loop time excludes
        the pass."""
        return _Span(self.begin_validation, self.end_validation)

    def train_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the batches of ``loader``, stamping Training data loading and Training loop;
        one Training loop measurement spans ``accumulation_steps`` batches.
        """
        return self._batches(loader, validation=False)

    def val_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the batches of ``loader``, stamping Validation data loading and loop."""
        return self._batches(loader, validation=True)

    def checkpoint(self, timeout_s: float = CHECKPOINT_TIMEOUT_S) -> bool:
        """Send what is buffered and have the sidecar take its state now; it writes every
        file and the state file right after answering (a failed write is logged, reported
        in ``sidecar status`` and retried).

        Returns True once the sidecar took the state (milliseconds: the writing does not
        hold up the loop), False when no sidecar answered within ``timeout_s``. The time
        spent here is kept out of the iteration it is called in.
        """
        self._settle()
        start_ns = perf_counter_ns()
        self._send_buffered(timeout_s)
        reply = self._sender.request({"type": wire.CHECKPOINT}, timeout_s)
        self._exclude_from_iteration(start_ns)
        return bool(reply and reply.get("ok"))

    def state_dict(self, timeout_s: float = STATE_TIMEOUT_S) -> dict[str, Any]:
        """The sidecar's state of this split, to keep inside the user's own checkpoint.

        The same content as the state file ``checkpoint()`` writes (a JSON-compatible dict
        with a ``schema`` key). Waits for the sidecar at most ``timeout_s`` seconds without
        progress; returns an empty dict when the run is not monitored or no sidecar
        answered (then with one RuntimeWarning saying why; loading an empty dict later is
        a no-op). Never raises. The time spent here is kept out of the iteration it is
        called in.
        """
        self._settle()
        start_ns = perf_counter_ns()
        self._send_buffered(timeout_s)
        reply = self._sender.request({"type": wire.STATE}, timeout_s)
        self._exclude_from_iteration(start_ns)
        state = reply.get("state") if reply and reply.get("ok") else None
        if not isinstance(state, dict):
            if self.monitored:  # an empty dict means nothing was saved: say why
                reason = reply.get("error") if reply else self._sender.last_failure
                warnings.warn(f"markers: state_dict() got no state ({reason})",
                              RuntimeWarning, stacklevel=2)
            return {}
        return state

    def load_state_dict(self, state: dict[str, Any],
                        timeout_s: float = STATE_TIMEOUT_S) -> bool:
        """Continue this split from ``state`` (from ``state_dict()`` of an earlier process):
        the same as ``start_run(resume=True)`` with the state kept by the user. Call it
        before the first epoch. Epochs continue from the saved ones. A state of any size
        is sent in parts. Waits at most ``timeout_s`` seconds without progress; True when
        the sidecar took the state, False (with one RuntimeWarning saying why) otherwise.
        Never raises.
        """
        if not state:
            return False
        self._settle()
        self._send_buffered(timeout_s)
        try:
            payload = json.dumps(state, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            reply: dict[str, Any] | None = {"error": f"the state is not JSON-compatible: {exc}"}
        else:  # any size: it travels in parts (``wire.PART_BYTES``)
            reply = self._sender.request({"type": wire.LOAD_STATE, "payload_bytes": len(payload)},
                                         timeout_s, payload=payload)
        if not (reply and reply.get("ok")):
            reason = reply.get("error") if reply else self._sender.last_failure
            warnings.warn(f"markers: saved state not loaded ({reason})", RuntimeWarning,
                          stacklevel=2)
            return False
        epoch = reply.get("epoch")
        if isinstance(epoch, int):
            self._epoch = epoch
            self._set_outside()
        return True

    def _send_buffered(self, timeout_s: float) -> None:
        """Before a request: send what is buffered. A send queue left full by a fast loop
        (the sidecar still reading its backlog) is waited on first, at most ``timeout_s``
        seconds, so these last records are not dropped."""
        self._sender.wait_for_room(timeout_s)
        self._buffer.flush()

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        """End the run: send everything (waiting at most ``GPU_DRAIN_S`` for GPU times
        still in flight), have the sidecar write its files (waiting as long as it reports
        progress on them, and at most ``FINISH_TIMEOUT_S`` without), close the connection.
        Safe to call more than once.

        An iteration, epoch or validation pass still open is cut short: kept in phases.tsv
        flagged incomplete (an iteration left by a loop's ``break`` before a completed
        finish is whole).
        """
        if self._finished:
            return
        self._finished = True
        end_ns = perf_counter_ns()
        self._close_all(status == "failed", end_ns)
        if self._buffer.gpu is not None:
            self._buffer.drain_gpu()
        self._send_buffered(FINISH_TIMEOUT_S)
        worker_phases = self._buffer.children.collect()
        if worker_phases:
            warnings.warn(f"markers: {worker_phases} phases inside DataLoader workers were not "
                          "measured (a worker process cannot send; time them in the main "
                          "process)", RuntimeWarning, stacklevel=2)
        reply = self._sender.request({"type": wire.FINISH, "status": status, "error": error,
                                      "end_ns": end_ns, "worker_phases": worker_phases},
                                     FINISH_TIMEOUT_S)
        if reply is None:
            warnings.warn("markers: the sidecar did not confirm writing the files "
                          f"({self._sender.last_failure})", RuntimeWarning, stacklevel=2)
        self._sender.close()
        self._buffer.children.close()
        if self._on_close is not None:
            self._on_close()

    def close_at_exit(self) -> None:
        """At interpreter exit: a run left open is finished (failed after an uncaught
        exception, which the interpreter records in ``sys.last_value``)."""
        if not self._finished:
            last = getattr(sys, "last_value", None)
            self.finish("failed" if last is not None else "completed",
                        describe(last) if last is not None else None)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 _tb: object) -> None:
        if exc is None or (exc_type is SystemExit and exc.code in (0, None)):  # type: ignore[union-attr]
            self.finish("completed")  # sys.exit(0) is a normal end
        else:
            self.finish("failed", describe(exc))

    # -- primitives: loop helpers, module hooks and framework callbacks drive these -----

    def begin_epoch(self) -> None:
        """An epoch starts now (an epoch still open is cut short)."""
        self._settle()
        now_ns = perf_counter_ns()
        if self._epoch_start_ns:
            self._record_in(self._context, wire.FLAG_INCOMPLETE, wire.EPOCH,
                            self._epoch_start_ns, now_ns)
        self._epoch_start_ns = self._boundary_ns = now_ns
        self._record_in(self._context, wire.FLAG_BEGIN, wire.EPOCH, now_ns, now_ns)

    def end_epoch(self, failed: bool = False) -> None:
        """The epoch begun by ``begin_epoch`` ends now: one Epoch measurement, or, when
        ``failed`` (cut short by an exception or a signal), a row flagged incomplete. An
        iteration still open ends with it. The next phases belong to the next epoch;
        sends what is buffered."""
        self._settle(failed)
        end_ns = self._boundary_ns = perf_counter_ns()
        self._end_open(failed, end_ns)
        if self._epoch_start_ns:
            self._record_in(self._context, wire.FLAG_INCOMPLETE if failed else 0, wire.EPOCH,
                            self._epoch_start_ns, end_ns)
        self._epoch_start_ns = 0
        self._epoch += 1
        self._set_outside()
        self._buffer.flush()

    def begin_validation(self) -> None:
        """A validation pass starts now. Inside a training iteration the pass suspends it:
        the pass is its own Validation measurement and the iteration's loop time
        excludes it."""
        self._settle()
        now_ns = perf_counter_ns()
        if self._validation_start_ns:
            self._record_in(self._context, wire.FLAG_INCOMPLETE, wire.VALIDATION,
                            self._validation_start_ns, now_ns)
        self._suspend(now_ns)
        self._validation_start_ns = self._boundary_ns = now_ns
        self._record_in(self._context, wire.FLAG_BEGIN, wire.VALIDATION, now_ns, now_ns)

    def end_validation(self, failed: bool = False) -> None:
        """The validation pass ends now: one Validation measurement (flagged incomplete
        when ``failed``); a training iteration it (or a validation iteration begun inside
        it) suspended goes on."""
        self._settle(failed)
        end_ns = self._boundary_ns = perf_counter_ns()
        if self._open is not None and self._open.validation:
            self._end_open(failed, end_ns)
        if self._validation_start_ns:
            self._record_in(self._context, wire.FLAG_INCOMPLETE if failed else 0,
                            wire.VALIDATION, self._validation_start_ns, end_ns)
        self._validation_start_ns = 0
        self._resume(end_ns)
        self._buffer.flush()

    def begin_iteration(self, validation: bool = False, start_ns: int | None = None) -> None:
        """A training (or validation) iteration starts at ``start_ns`` (perf_counter_ns;
        default now): the phases that follow belong to it. With accumulation, one training
        iteration is one optimization step. An iteration of the same kind still open is cut
        short (flagged incomplete); a validation iteration inside a training one suspends
        it."""
        if start_ns is None:
            start_ns = perf_counter_ns()
        if self._left:
            self._settle()
        if self._open is not None:
            if validation and not self._open.validation:
                self._suspend(start_ns)
            else:
                self._drop_open(start_ns)
        elif not validation and self._suspended is not None:
            self._resume(start_ns)  # the suspended one was never ended: cut it short
            self._drop_open(start_ns)
        context = (wire.FLAG_IN_ITERATION | (wire.FLAG_VALIDATION if validation else 0),
                   self._epoch, self._iterations[validation], self._net_batches)
        self._open = _Iteration(validation, start_ns, context)
        self._set_context(*context)

    def data_loaded(self, start_ns: int, end_ns: int | None = None) -> None:
        """The open iteration's batch was fetched from ``start_ns`` to ``end_ns`` (default
        now; perf_counter_ns): one Training (or Validation) data loading phase."""
        validation = self._open.validation if self._open is not None else False
        self._buffer.record(wire.VALIDATION_DATA_LOADING if validation
                            else wire.TRAINING_DATA_LOADING, start_ns,
                            perf_counter_ns() if end_ns is None else end_ns)

    def batch_done(self) -> None:
        """A batch went through the network (counts towards warmup and towards the
        batches of the open iteration, which throughput counts)."""
        self._net_batches += 1
        if self._open is not None:
            self._open.batches += 1

    def end_iteration(self, end_ns: int | None = None) -> None:
        """The open iteration ends at ``end_ns`` (default now): one Training (or Validation)
        loop measurement holding the batches it really held. Without an open iteration,
        nothing happens. Phases after it are outside any iteration until the next one."""
        iteration = self._open
        if iteration is None:
            return
        self._open = None
        self._end(iteration, perf_counter_ns() if end_ns is None else end_ns, 0)
        self._set_outside()

    def leave_iteration(self) -> None:
        """Phases from now on are outside any iteration; an iteration still open is cut
        short: kept in phases.tsv flagged incomplete, never measured."""
        self._settle()
        now_ns = perf_counter_ns()
        if self._open is not None:
            self._drop_open(now_ns)
        if self._suspended is not None:
            self._resume(now_ns)
            self._drop_open(now_ns)
        self._set_outside()

    # -- the iteration model --------------------------------------------------------

    def _set_context(self, flags: int, epoch: int, iteration: int, batch: int) -> None:
        self._context = (flags, epoch, iteration, batch)
        self._buffer.set_context(flags, epoch, iteration, batch)

    def _set_outside(self) -> None:
        self._set_context(0, self._epoch, -1, self._net_batches)

    def _record_in(self, context: tuple[int, int, int, int], flags: int, tag: int,
                   start_ns: int, end_ns: int) -> None:
        """Record one slot under ``context`` with ``flags`` added, then go back to the
        current context (epoch spans, flagged and late loop records)."""
        buffer = self._buffer
        if self._open is not None:
            self._open.recorded |= buffer.recorded_since_context()
        context_flags, epoch, iteration, batch = context
        buffer.set_context(context_flags | flags, epoch, iteration, batch)
        buffer.record(tag, start_ns, end_ns)
        buffer.set_context(*self._context)

    def _end(self, iteration: _Iteration, end_ns: int, flags: int) -> None:
        """Send ``iteration``'s loop record (its batch count in the tag; its suspended
        time taken off its end, so the wall time excludes it)."""
        validation = iteration.validation
        tag = (wire.VALIDATION_LOOP if validation else wire.TRAINING_LOOP) \
            | iteration.batches << wire.BATCHES_SHIFT
        end_ns = max(end_ns - iteration.excluded_ns, iteration.start_ns)
        if not flags and iteration.context == self._context:
            self._buffer.record(tag, iteration.start_ns, end_ns)
        else:
            self._record_in(iteration.context, flags, tag, iteration.start_ns, end_ns)
        self._iterations[validation] += 1
        if not validation and self._buffer.gpu is None \
                and self._iterations[False] % GPU_CHECK_EVERY == 0:
            self._open_gpu()

    def _drop_open(self, end_ns: int) -> None:
        """Cut the open iteration short: flagged incomplete when anything belongs to it,
        else forgotten (nothing on the wire names it)."""
        iteration = self._open
        if iteration is None:
            return
        self._open = None
        if iteration.batches or iteration.recorded or (
                iteration.context == self._context and self._buffer.recorded_since_context()):
            self._end(iteration, end_ns, wire.FLAG_INCOMPLETE)
        self._set_outside()

    def _end_open(self, failed: bool, end_ns: int) -> None:
        """At the end of an epoch, a pass or the run: an iteration still open (or
        suspended) ends there, whole when it held a batch and nothing failed."""
        if self._suspended is not None and self._open is None:
            self._resume(end_ns)
        iteration = self._open
        if iteration is None:
            return
        if iteration.batches and not failed:
            self.end_iteration(end_ns)
        else:
            self._drop_open(end_ns)

    def _close_all(self, failed: bool, end_ns: int) -> None:
        """At finish: settle, end what is open (an epoch or pass never ended is cut)."""
        self._settle(failed)
        if self._open is not None and self._open.validation:
            self._end_open(failed, end_ns)
        self._end_open(failed, end_ns)
        for phase, start_ns in ((wire.VALIDATION, self._validation_start_ns),
                                (wire.EPOCH, self._epoch_start_ns)):
            if start_ns:
                self._record_in(self._context, wire.FLAG_INCOMPLETE, phase, start_ns, end_ns)
        self._validation_start_ns = self._epoch_start_ns = 0

    def _leave_loop(self, end_ns: int) -> None:
        """A loop was left (``break``, or an exception in its body): its iteration ends
        at ``end_ns``, whole or cut short as the next primitive tells (``_settle``)."""
        iteration = self._open
        if iteration is None:
            return
        self._open = None
        self._left.append((iteration, end_ns))
        self._set_outside()

    def _settle(self, failed: bool = False) -> None:
        """Decide the iterations of loops left since the last primitive: cut short when
        ``failed`` (an exception reached an epoch, a pass or the run), else whole."""
        if self._left:
            left, self._left = self._left, []
            for iteration, end_ns in left:
                self._end(iteration, end_ns, wire.FLAG_INCOMPLETE if failed else 0)

    def _suspend(self, now_ns: int) -> bool:
        """Suspend the open training iteration (a validation inside it); True if one was."""
        iteration = self._open
        if iteration is None or iteration.validation or self._suspended is not None:
            return False
        iteration.recorded |= self._buffer.recorded_since_context()
        self._suspended = (iteration, now_ns)
        self._open = None
        self._set_outside()
        return True

    def _resume(self, now_ns: int) -> None:
        """Go on with the suspended training iteration; the time away is excluded."""
        if self._suspended is None:
            return
        if self._open is not None:  # a validation iteration left open inside it
            self._drop_open(now_ns)
        iteration, since_ns = self._suspended
        self._suspended = None
        iteration.excluded_ns += now_ns - since_ns
        self._open = iteration
        self._set_context(*iteration.context)

    # -- phases and forks -------------------------------------------------------------

    def _new_phase(self, name: str) -> Phase | _NullPhase:
        phase_id = wire.CANONICAL_PHASE_NAMES.get(name)
        if phase_id is None:
            try:
                clean = wire.custom_phase_name(str(name))
            except ValueError as exc:
                warnings.warn(f"markers: phase {name!r} refused ({exc}); it is not measured",
                              RuntimeWarning, stacklevel=3)
                return _NULL_PHASE
            same = self._phases.get(clean)  # "a\tb" is the phase "a b"
            if same is not None:
                return same
            if self._next_custom - wire.FIRST_CUSTOM_ID >= wire.MAX_CUSTOM_PHASES:
                warnings.warn(f"markers: phase {name!r} refused (more than "
                              f"{wire.MAX_CUSTOM_PHASES} custom phases); it is not measured",
                              RuntimeWarning, stacklevel=3)
                return _NULL_PHASE
            phase_id = self._next_custom
            self._next_custom += 1
            self._buffer.declare(phase_id, clean)
            kind = Phase if self._buffer.gpu is None else GpuPhase
            marker = self._phases[clean] = kind(self._buffer, phase_id)
            return marker
        kind = Phase if self._buffer.gpu is None else GpuPhase
        return kind(self._buffer, phase_id)

    def _markers(self) -> list[Phase]:
        return [m for m in self._phases.values() if isinstance(m, Phase)]

    def _before_fork(self) -> None:
        if not self._finished:
            self._buffer.children.before_fork()

    def _enter_child(self) -> None:
        """In a forked child (a DataLoader worker): this process cannot send; its phases
        are counted for the parent, on the CPU path, and the child never finishes the
        run."""
        self._finished = True
        self._buffer.enter_child()
        for marker in self._markers():
            marker.__class__ = Phase
            marker._start = marker._depth = 0

    def _exclude_from_iteration(self, start_ns: int) -> None:
        """Keep the time since ``start_ns`` (a checkpoint, a state request) out of the open
        iteration: its loop record's end moves back by it (its start, and ``iteration``,
        which hooks compare, stay the same)."""
        if self._open is not None:
            self._open.excluded_ns += perf_counter_ns() - start_ns

    # -- what hooks and callbacks read to agree with the loop drivers -----------------

    @property
    def iteration(self) -> tuple[bool, int] | None:
        """The open iteration as ``(validation, start_ns)``, or None between iterations."""
        it = self._open
        return (it.validation, it.start_ns) if it is not None else None

    @property
    def in_validation(self) -> bool:
        """True between ``begin_validation`` and ``end_validation``."""
        return self._validation_start_ns != 0

    @property
    def last_boundary_ns(self) -> int:
        """When the latest epoch or validation pass began or ended (perf_counter_ns; 0
        before any): time before it belongs to no iteration that starts after it."""
        return self._boundary_ns

    def batch_seen(self, validation: bool, batch: Any) -> None:
        """A batch of the open iteration was fetched: its size is read (when ``start_run``
        was not given it) from the first batch of each iteration, and sent when it
        changed."""
        if self._read_sizes[validation] == -1:
            return
        iteration = self._iterations[validation]
        if self._sized[validation] == iteration:
            return
        self._sized[validation] = iteration
        self._note_batch_size(validation, batch)

    # -- loop drivers ---------------------------------------------------------------

    def _batches(self, loader: Iterable[Any], validation: bool) -> Iterator[Any]:
        """The loop driver: an iteration begins before its first batch is fetched (phases
        timed inside the loader belong to the batch it loads) and ends after its last
        batch (``accumulation_steps`` for training) or where the loop is left."""
        per_iteration = 1 if validation else self._accumulation
        suspended = validation and self._suspend(perf_counter_ns())
        self._open_gpu()  # CUDA may have come up since the last loop
        settings = loader_control(loader, validation)
        if settings is not None:  # the report's advice on input-bound steps
            self._sender.send_control(settings)
        iterator = iter(loader)
        iteration: _Iteration | None = None  # the iteration this loop has open
        buffer = self._buffer
        fetched: tuple[int, int] | None = None  # the buffer when a yielded batch was fetched
        try:
            while True:
                start_ns = perf_counter_ns()
                if iteration is None:
                    self.begin_iteration(validation, start_ns)
                    iteration = self._open
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                self.data_loaded(start_ns)
                self.batch_seen(validation, batch)
                fetched = (buffer.n, buffer.flushes)
                yield batch
                fetched = None
                self.batch_done()
                if iteration.batches == per_iteration:
                    # The next turn begins the next iteration at once: no context between.
                    self._open = None
                    self._end(iteration, perf_counter_ns(), 0)
                    iteration = None
            if iteration is not None and iteration is self._open:
                # The last, shorter step ends where the fetch that found no batch began;
                # a step with no batch is no iteration.
                if iteration.batches:
                    self.end_iteration(start_ns)
                else:
                    self._drop_open(start_ns)
        except GeneratorExit:
            # Left with ``break`` or by an exception in the loop body. The yielded batch went
            # through the network when the body recorded anything after its fetch. An
            # iteration holding a batch ends here, whole or cut short as the next
            # primitive tells (an epoch, pass or run ending with an exception); one
            # without (left before its batch was used) is cut short.
            if fetched is not None and fetched != (buffer.n, buffer.flushes):
                self.batch_done()
            if iteration is not None and iteration is self._open:
                if iteration.batches:
                    self._leave_loop(perf_counter_ns())
                else:
                    self._drop_open(perf_counter_ns())
            raise
        except BaseException:
            # The loader itself raised: the iteration it was fetching is cut short.
            if iteration is not None and iteration is self._open:
                self._drop_open(perf_counter_ns())
            raise
        finally:
            if suspended:
                self._resume(perf_counter_ns())

    def _note_batch_size(self, validation: bool, batch: Any) -> None:
        """Tell the sidecar the batch size from this iteration on when it changed (the
        first batch of an iteration counts); a batch that cannot tell gives one warning."""
        size = _batch_size(batch) or 0
        if size == self._read_sizes[validation]:
            return
        first = self._read_sizes[validation] is None
        self._read_sizes[validation] = size
        kind = "validation" if validation else "train"
        self._sender.send_control({"type": wire.BATCH_SIZE, "kind": kind, "value": size or None,
                                   "iteration": self._iterations[validation]})
        if not size and first:
            given = "val_batch_size" if validation else "train_batch_size"
            warnings.warn(f"markers: the {kind} batch size cannot be read from a batch of "
                          f"type {type(batch).__name__} (ambiguous: give {given}= to "
                          "start_run); its throughput is reported as unknown",
                          RuntimeWarning, stacklevel=3)

    def prefer_device(self, device: Any) -> None:
        """Time the CUDA device ``device`` names (a module: where its parameters are) when
        GPU timing starts, unless ``start_run(device=...)`` already said which."""
        if self._device is None:
            self._device = device

    def _open_gpu(self) -> None:
        """Start GPU timing once the script uses CUDA (checked at loop starts and every
        ``GPU_CHECK_EVERY`` steps until then; a CPU-only run never touches torch.cuda), on
        the device ``markers.cuda.choose_device`` picks."""
        if self._buffer.gpu is not None or "torch" not in sys.modules:
            return
        from markers.gpu import open_gpu_timer

        timer = open_gpu_timer(device=self._device)
        if timer is not None:
            self._buffer.use_gpu(timer)
            for marker in self._markers():
                marker.__class__ = GpuPhase
            self._sender.send_control({"type": wire.GPU, "uuid": timer.device_uuid,
                                       "name": timer.device_name})


class _NullPhase:
    """A phase marker that measures nothing (of a run that is not monitored)."""

    __slots__ = ()

    def __enter__(self) -> _NullPhase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def begin(self) -> None:
        """Does nothing."""

    def end(self) -> None:
        """Does nothing."""

    def __call__(self, function: F) -> F:
        return function


_NULL_PHASE = _NullPhase()


class NullRun:
    """A run that is not monitored: the interface of ``Run``, and nothing happens.

    ``start_run`` returns it when monitoring cannot even be attempted (a configuration it
    cannot use); the training loop runs unchanged.
    """

    monitored = False
    out_dir: Path | None = None
    dropped = 0
    iteration: tuple[bool, int] | None = None
    in_validation = False
    last_boundary_ns = 0

    def phase(self, name: str) -> _NullPhase:
        """A marker that measures nothing."""
        return _NULL_PHASE

    def epoch(self) -> _NullPhase:
        """A context manager that measures nothing."""
        return _NULL_PHASE

    validation = epoch

    def train_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of ``loader``, unchanged."""
        return iter(loader)

    val_batches = train_batches

    def begin_iteration(self, validation: bool = False, start_ns: int | None = None) -> None:
        """Does nothing."""

    def data_loaded(self, start_ns: int, end_ns: int | None = None) -> None:
        """Does nothing."""

    def end_iteration(self, end_ns: int | None = None) -> None:
        """Does nothing."""

    def batch_seen(self, validation: bool, batch: Any) -> None:
        """Does nothing."""

    def _nothing(self, *args: object, **kwargs: object) -> None:
        return None

    begin_epoch = end_epoch = begin_validation = end_validation = _nothing
    batch_done = leave_iteration = close_at_exit = _nothing

    def checkpoint(self, timeout_s: float = CHECKPOINT_TIMEOUT_S) -> bool:
        """Nothing is written: False."""
        return False

    def state_dict(self, timeout_s: float = STATE_TIMEOUT_S) -> dict[str, Any]:
        """No state: an empty dict (loading it later is a no-op)."""
        return {}

    def load_state_dict(self, state: dict[str, Any],
                        timeout_s: float = STATE_TIMEOUT_S) -> bool:
        """Nothing is loaded: False."""
        return False

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        """Does nothing."""

    def __enter__(self) -> NullRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None
