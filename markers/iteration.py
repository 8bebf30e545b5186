"""The iteration model of one run as a state machine: epochs, validation passes and the
iterations inside them, turned into loop records and context slots.

An iteration runs from fetching its batch to fetching the next (or leaving the loop);
every iteration that holds anything ends with exactly one loop record, complete or
flagged incomplete, so nothing of it can move into a later one (docs/iteration-model.md).
``markers.run.Run`` owns one ``Iterations`` and drives it from its loop drivers, hooks
and callbacks.

How an iteration ends, one verb each:

* ``end_iteration``: whole, now (its loop record);
* ``end_full_step``: a loop driver's step held all its batches: whole, and the next
  iteration begins at once (the one call a step of the loop driver, ``markers.driver``);
* ``cut_open``: cut short now (flagged incomplete, or forgotten when nothing names it);
* ``defer_left_loop``: a loop was left; whole or cut is decided later by
  ``settle_left_loops``, at the next primitive (cut when an exception reached it);
* ``_close_at_boundary``: at an epoch, pass or run end: whole when it held a batch and
  nothing failed, else cut;
* ``close_all``: at finish, everything still open (epochs and passes too);
* ``_send_loop_record``: the one place a loop record is written.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from time import perf_counter_ns

from markers import wire
from markers.buffer import RecordBuffer
from markers.phase import PURE_PYTHON_ENV

GPU_CHECK_EVERY = 100  # steps between checks whether the script started using CUDA

Context = tuple[int, int, int, int]  # (flags, epoch, iteration, batch)


class OpenIteration:
    """An iteration begun and not yet ended: where it started, its context slot, the
    batches it held and the time it was suspended (a validation inside it). A loop
    driver's goes on as the next one once it ended whole (``Iterations.end_full_step``
    restarts it in place: one allocation less a step)."""

    __slots__ = (
        "batches",
        "context",
        "excluded_ns",
        "explicit_end",
        "recorded",
        "start_ns",
        "validation",
    )

    def __init__(
        self, validation: bool, start_ns: int, context: Context, explicit_end: bool = False
    ) -> None:
        self.validation = validation
        self.explicit_end = explicit_end  # whole only through end_iteration
        self.start_ns = start_ns
        self.context = context
        self.batches = 0
        self.excluded_ns = 0
        self.recorded = False  # phases recorded in it before a suspension


class Span:
    """A context manager over a begin/end pair of primitives (epoch, validation); an
    exception leaving it ends the span as cut short (``failed``)."""

    __slots__ = ("_begin", "_end")

    def __init__(self, begin: Callable[[], None], end: Callable[[bool], None]) -> None:
        self._begin, self._end = begin, end

    def __enter__(self) -> Span:
        self._begin()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self._end(exc_type is not None)


class Iterations:
    """The epochs, validation passes and iterations of one run. Times are
    ``perf_counter_ns``. ``check_gpu`` is called every ``GPU_CHECK_EVERY`` training
    iterations until GPU timing started (the script may start using CUDA late)."""

    __slots__ = (
        "_buffer",
        "_check_gpu",
        "_context",
        "_epoch_start_ns",
        "_left",
        "_suspended",
        "_validation_start_ns",
        "boundary_ns",
        "counts",
        "epoch",
        "net_batches",
        "open",
    )

    def __init__(
        self, buffer: RecordBuffer, first_epoch: int, check_gpu: Callable[[], None]
    ) -> None:
        self._buffer = buffer
        self._check_gpu = check_gpu
        self.epoch = first_epoch  # epochs continue across resumes
        self._epoch_start_ns = 0  # 0: no epoch open
        self._validation_start_ns = 0  # 0: no validation pass open
        self.boundary_ns = 0  # the latest begin or end of an epoch or validation pass
        self.counts = [0, 0]  # training, validation iterations so far (by `validation`)
        self.net_batches = 0  # batches that went through the network in this process
        self.open: OpenIteration | None = None
        self._suspended: tuple[OpenIteration, int] | None = None  # (iteration, since ns)
        self._left: list[tuple[OpenIteration, int]] = []  # loops left: (iteration, end ns)
        self._context: Context = (0, self.epoch, -1, 0)  # the buffer's, this very tuple
        buffer.set_context(*self._context)

    @property
    def in_validation(self) -> bool:
        """True between ``begin_validation`` and ``end_validation``."""
        return self._validation_start_ns != 0

    # -- epochs and validation passes -------------------------------------------------

    def begin_epoch(self, number: int | None = None) -> None:
        """An epoch starts now (an epoch still open is cut short), numbered ``number``
        when given."""
        self.settle_left_loops()
        now_ns = perf_counter_ns()
        if self._epoch_start_ns:
            self._record_in(
                self._context, wire.FLAG_INCOMPLETE, wire.EPOCH, self._epoch_start_ns, now_ns
            )
        if number is not None and number != self.epoch and self.open is None:
            self.epoch = number
            self.set_outside()
        self._epoch_start_ns = self.boundary_ns = now_ns
        self._record_in(self._context, wire.FLAG_BEGIN, wire.EPOCH, now_ns, now_ns)

    def end_epoch(self, failed: bool = False) -> None:
        """The epoch ends now: one Epoch record (flagged incomplete when ``failed``); an
        iteration still open ends with it; sends what is buffered."""
        self.settle_left_loops(failed)
        end_ns = self.boundary_ns = perf_counter_ns()
        self._close_at_boundary(failed, end_ns)
        if self._epoch_start_ns:
            self._record_in(
                self._context,
                wire.FLAG_INCOMPLETE if failed else 0,
                wire.EPOCH,
                self._epoch_start_ns,
                end_ns,
            )
        self._epoch_start_ns = 0
        self.epoch += 1
        self.set_outside()
        self._buffer.flush()

    def begin_validation(self) -> None:
        """A validation pass starts now; it suspends an open training iteration."""
        self.settle_left_loops()
        now_ns = perf_counter_ns()
        if self._validation_start_ns:
            self._record_in(
                self._context,
                wire.FLAG_INCOMPLETE,
                wire.VALIDATION,
                self._validation_start_ns,
                now_ns,
            )
        self.suspend(now_ns)
        self._validation_start_ns = self.boundary_ns = now_ns
        self._record_in(self._context, wire.FLAG_BEGIN, wire.VALIDATION, now_ns, now_ns)

    def end_validation(self, failed: bool = False) -> None:
        """The validation pass ends now (flagged incomplete when ``failed``); the training
        iteration it suspended goes on; sends what is buffered."""
        self.settle_left_loops(failed)
        end_ns = self.boundary_ns = perf_counter_ns()
        if self.open is not None and self.open.validation:
            self._close_at_boundary(failed, end_ns)
        if self._validation_start_ns:
            self._record_in(
                self._context,
                wire.FLAG_INCOMPLETE if failed else 0,
                wire.VALIDATION,
                self._validation_start_ns,
                end_ns,
            )
        self._validation_start_ns = 0
        self.resume(end_ns)
        self._buffer.flush()
        # The send (a process wake-up, milliseconds on a busy machine) ends the pass's
        # work: the resumed training iteration leaves it out, as it leaves the pass.
        self.exclude_since(end_ns)

    # -- iterations -------------------------------------------------------------------

    def begin_iteration(
        self, validation: bool = False, start_ns: int | None = None, explicit_end: bool = False
    ) -> OpenIteration:
        """An iteration starts at ``start_ns`` (default now); returns it (the open one).
        One of the same kind still open is cut short; a validation iteration inside a
        training one suspends it. With ``explicit_end`` only ``end_iteration`` ends it
        whole: the end of an epoch, a pass or the run cuts it short."""
        if start_ns is None:
            start_ns = perf_counter_ns()
        if self._left:
            self.settle_left_loops()
        if self.open is not None:
            if validation and not self.open.validation:
                self.suspend(start_ns)
            else:
                self.cut_open(start_ns)
        elif not validation and self._suspended is not None:
            self.resume(start_ns)  # the suspended one was never ended: cut it short
            self.cut_open(start_ns)
        context = (
            wire.FLAG_IN_ITERATION | (wire.FLAG_VALIDATION if validation else 0),
            self.epoch,
            self.counts[validation],
            self.net_batches,
        )
        self.open = iteration = OpenIteration(validation, start_ns, context, explicit_end)
        self._set_context(context)
        return iteration

    def data_loaded(self, start_ns: int, end_ns: int | None = None) -> None:
        """The open iteration's batch was fetched from ``start_ns`` to ``end_ns`` (default
        now): one Training (or Validation) data loading phase."""
        validation = self.open.validation if self.open is not None else False
        self._buffer.record(
            wire.VALIDATION_DATA_LOADING if validation else wire.TRAINING_DATA_LOADING,
            start_ns,
            perf_counter_ns() if end_ns is None else end_ns,
        )

    def batch_done(self) -> None:
        """A batch went through the network (warmup; the open iteration's batches)."""
        self.net_batches += 1
        if self.open is not None:
            self.open.batches += 1

    def begin_training(self, start_ns: int, loaded_ns: int) -> None:
        """A training iteration that only ``end_iteration`` ends whole begins at
        ``start_ns``; its batch was fetched from then to ``loaded_ns`` (its data loading
        phase): what instrument()'s hooks begin at a training batch."""
        self.begin_iteration(False, start_ns, explicit_end=True)
        self.data_loaded(start_ns, loaded_ns)

    def end_iteration(self, end_ns: int | None = None) -> None:
        """The open iteration ends whole at ``end_ns`` (default now); phases after it are
        outside any iteration. Without an open iteration, nothing happens."""
        iteration = self.open
        if iteration is None:
            return
        self.open = None
        self._send_loop_record(iteration, perf_counter_ns() if end_ns is None else end_ns, 0)
        self.set_outside()

    def end_full_step(self, iteration: OpenIteration, now_ns: int) -> OpenIteration:
        """A loop driver's ``iteration`` held all its batches: it ends whole at ``now_ns``
        and the next iteration of its kind begins there (the loop fetches its batch
        next); returns that one, now open.

        Once a step: when ``iteration`` is the open one, its context the current one and
        nothing was left or suspended (``begin_iteration`` would have nothing to settle,
        cut or resume), its loop record and the next context go into the buffer in one
        call and ``iteration`` itself goes on as the next (nothing else holds it). Else
        ``_send_loop_record`` and ``begin_iteration`` take the steps one by one; the
        slots are the same."""
        validation = iteration.validation
        if (
            self.open is not iteration
            or iteration.context is not self._context
            or self._left
            or self._suspended is not None
        ):
            self.open = None
            self._send_loop_record(iteration, now_ns, 0)
            return self.begin_iteration(validation, now_ns)
        loop_slot = self._count_loop(iteration, now_ns)
        # The next iteration of the same kind: the same flags, the next number.
        context = (iteration.context[0], self.epoch, self.counts[validation], self.net_batches)
        iteration.start_ns = now_ns
        iteration.context = context
        iteration.batches = iteration.excluded_ns = 0
        iteration.recorded = False
        self._context = context
        self._buffer.record_and_context(*loop_slot, context)
        return iteration

    def leave_iteration(self) -> None:
        """Phases from now on are outside any iteration; one still open (or suspended) is
        cut short."""
        self.settle_left_loops()
        now_ns = perf_counter_ns()
        if self.open is not None:
            self.cut_open(now_ns)
        if self._suspended is not None:
            self.resume(now_ns)
            self.cut_open(now_ns)
        self.set_outside()

    def cut_open(self, end_ns: int) -> None:
        """Cut the open iteration short at ``end_ns``: flagged incomplete when anything
        belongs to it, else forgotten (nothing on the wire names it)."""
        iteration = self.open
        if iteration is None:
            return
        self.open = None
        if (
            iteration.batches
            or iteration.recorded
            or (iteration.context == self._context and self._buffer.recorded_since_context())
        ):
            self._send_loop_record(iteration, end_ns, wire.FLAG_INCOMPLETE)
        self.set_outside()

    def defer_left_loop(self, end_ns: int) -> None:
        """A loop was left (``break``, or an exception in its body): its open iteration
        ends at ``end_ns``, whole or cut as the next primitive tells
        (``settle_left_loops``)."""
        iteration = self.open
        if iteration is None:
            return
        self.open = None
        self._left.append((iteration, end_ns))
        self.set_outside()

    def settle_left_loops(self, failed: bool = False) -> None:
        """Decide the iterations of loops left since the last primitive: cut short when
        ``failed`` (an exception reached an epoch, a pass or the run), else whole."""
        if self._left:
            left, self._left = self._left, []
            for iteration, end_ns in left:
                self._send_loop_record(iteration, end_ns, wire.FLAG_INCOMPLETE if failed else 0)

    def close_all(self, failed: bool, end_ns: int) -> None:
        """At finish: settle, end what is open (an epoch or pass never ended is cut)."""
        self.settle_left_loops(failed)
        if self.open is not None and self.open.validation:
            self._close_at_boundary(failed, end_ns)
        self._close_at_boundary(failed, end_ns)
        for phase, start_ns in (
            (wire.VALIDATION, self._validation_start_ns),
            (wire.EPOCH, self._epoch_start_ns),
        ):
            if start_ns:
                self._record_in(self._context, wire.FLAG_INCOMPLETE, phase, start_ns, end_ns)
        self._validation_start_ns = self._epoch_start_ns = 0

    def _close_at_boundary(self, failed: bool, end_ns: int) -> None:
        """At the end of an epoch, a pass or the run: an iteration still open (or
        suspended) ends there, whole when it held a batch and nothing failed, else cut."""
        if self._suspended is not None and self.open is None:
            self.resume(end_ns)
        iteration = self.open
        if iteration is None:
            return
        if iteration.batches and not failed and not iteration.explicit_end:
            self.end_iteration(end_ns)
        else:
            self.cut_open(end_ns)

    def suspend(self, now_ns: int) -> bool:
        """Suspend the open training iteration (a validation inside it); True if one was."""
        iteration = self.open
        if iteration is None or iteration.validation or self._suspended is not None:
            return False
        iteration.recorded |= self._buffer.recorded_since_context()
        self._suspended = (iteration, now_ns)
        self.open = None
        self.set_outside()
        return True

    def resume(self, now_ns: int) -> None:
        """Go on with the suspended training iteration; the time away is excluded."""
        if self._suspended is None:
            return
        if self.open is not None:  # a validation iteration left open inside it
            self.cut_open(now_ns)
        iteration, since_ns = self._suspended
        self._suspended = None
        iteration.excluded_ns += now_ns - since_ns
        self.open = iteration
        self._set_context(iteration.context)

    def exclude_since(self, start_ns: int) -> None:
        """Keep the time since ``start_ns`` (a checkpoint, a state request) out of the open
        iteration: its loop record's end moves back by it (its start, and its number,
        which hooks compare, stay the same)."""
        if self.open is not None:
            self.open.excluded_ns += perf_counter_ns() - start_ns

    def record_outside(self, phase_id: int, start_ns: int, end_ns: int) -> None:
        """One phase from ``start_ns`` to ``end_ns`` in no iteration (a checkpoint save,
        made while an iteration may be open or suspended)."""
        self._record_in((0, self.epoch, -1, self.net_batches), 0, phase_id, start_ns, end_ns)

    # -- records and contexts ---------------------------------------------------------

    def set_outside(self) -> None:
        """Phases from now on belong to no iteration."""
        self._set_context((0, self.epoch, -1, self.net_batches))

    def _set_context(self, context: Context) -> None:
        """``context`` is current: kept as this very tuple, so ``end_full_step`` can tell
        an iteration's own context by identity."""
        self._context = context
        self._buffer.set_context(*context)

    def _record_in(
        self, context: Context, flags: int, tag: int, start_ns: int, end_ns: int
    ) -> None:
        """Record one slot under ``context`` with ``flags`` added, then go back to the
        current context (epoch spans, flagged and late loop records)."""
        buffer = self._buffer
        if self.open is not None:
            self.open.recorded |= buffer.recorded_since_context()
        context_flags, epoch, iteration, batch = context
        buffer.set_context(context_flags | flags, epoch, iteration, batch)
        buffer.record(tag, start_ns, end_ns)
        buffer.set_context(*self._context)

    def _send_loop_record(self, iteration: OpenIteration, end_ns: int, flags: int) -> None:
        """Count ``iteration`` and write its loop record (``_count_loop``)."""
        tag, start_ns, end_ns = self._count_loop(iteration, end_ns)
        if not flags and iteration.context == self._context:
            self._buffer.record(tag, start_ns, end_ns)
        else:
            self._record_in(iteration.context, flags, tag, start_ns, end_ns)

    def _count_loop(self, iteration: OpenIteration, end_ns: int) -> tuple[int, int, int]:
        """Count ``iteration`` as ended and return its loop slot: its batch count in the
        tag; its suspended time taken off its end, so the wall time excludes it. Every
        ``GPU_CHECK_EVERY`` training iterations without GPU timing, first look whether the
        script started using CUDA (a loop record has no GPU slot either way)."""
        validation = iteration.validation
        counts = self.counts
        counts[validation] += 1
        if not validation and self._buffer.gpu is None and counts[False] % GPU_CHECK_EVERY == 0:
            self._check_gpu()
        start_ns = iteration.start_ns
        return (
            wire.LOOP_ID[validation] | iteration.batches << wire.BATCHES_SHIFT,
            start_ns,
            max(end_ns - iteration.excluded_ns, start_ns),
        )


# -- the verbs instrument()'s hooks call once a step ------------------------------------
# Each is one C call (markers/_iteration.c: the common case there, the method of the
# same name otherwise, so the slots are the same) where markers._speedups is built and not
# switched off (``PURE_PYTHON_ENV``), else the methods themselves (``PURE_VERBS``);
# ``ACCELERATED`` says which.

Verbs = tuple[
    Callable[[Iterations, int], None],
    Callable[[Iterations, int, int], None],
    Callable[[Iterations], None],
]
PURE_VERBS: Verbs = (Iterations.end_iteration, Iterations.begin_training, Iterations.batch_done)


def accelerated_verbs() -> Verbs | None:
    """``(end_whole, begin_training, batch_done)`` in C, bound to this module's ids and
    types; None when ``markers._speedups`` lacks them (not built, or an older build)."""
    try:
        from markers import _speedups
    except ImportError:
        return None
    if wire.BATCHES_SHIFT != _speedups.BATCHES_SHIFT or not hasattr(_speedups, "end_whole"):
        return None
    return (
        functools.partial(
            _speedups.end_whole, wire.LOOP_ID[False], wire.LOOP_ID[True], GPU_CHECK_EVERY
        ),
        functools.partial(_speedups.begin_training, OpenIteration, wire.TRAINING_DATA_LOADING),
        _speedups.batch_done,
    )


def _verbs() -> Verbs:
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return PURE_VERBS
    return accelerated_verbs() or PURE_VERBS


VERBS: Verbs = _verbs()  # what the hooks call: (end_whole, begin_training, batch_done)
ACCELERATED: bool = VERBS is not PURE_VERBS
