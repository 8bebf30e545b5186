"""The loop driver: what ``for batch in run.train_batches(loader):`` iterates.

An iteration begins before its first batch is fetched (phases timed inside the loader
belong to the batch it loads) and ends after its last batch (``accumulation_steps`` for
training) or where the loop is left. One step of the loop (the batch before went
through the network; the iteration that held all its batches ends and the next begins;
the next batch is fetched, its data loading phase recorded and its size read) is
``__next__``: from ``markers._speedups.DriverBase`` (C: no Python frame of its own)
when it is built and not switched off (``markers.phase.PURE_PYTHON_ENV``), else from
``PureStep``, the same semantics in Python; ``ACCELERATED`` says which. What happens
once a loop (its start, its end, leaving it) is ``LoopDriver``'s, in Python, for both.

It behaves as the generator it replaces: nothing happens before the first ``next``;
leaving the loop (``break``, an exception in its body) closes it when the ``for``
statement lets go of it, or at ``close()``; an exception from the loader (or from the
driver itself) cuts the iteration being fetched short and ends the loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from markers import wire
from markers.batches import BatchSizes
from markers.buffer import RecordBuffer
from markers.iteration import GPU_CHECK_EVERY, Iterations, OpenIteration
from markers.phase import PURE_PYTHON_ENV

# Where a loop is (``_state``); the C step uses the same numbers.
NEW = 0  # no batch asked for yet: nothing happened
RUNNING = 1  # a batch was handed out and the loop body has it
DONE = 2  # ended: exhausted, failed or closed

SLOTS = (
    "_buffer",  # markers.buffer.RecordBuffer
    "_check_every",  # GPU_CHECK_EVERY: the step that counts it leaves to Python
    "_counts",  # the model's iterations so far, by validation (its own list)
    "_fetched_flushes",  # the buffer when the batch handed out was fetched (n -1: none)
    "_fetched_n",
    "_iteration",  # the iteration this loop has open
    "_iterator",  # iter(loader), from the first next
    "_loader",  # until the first next
    "_loading",  # the data loading phase id of this loop's kind
    "_loop_id",  # and its loop phase id
    "_model",  # markers.iteration.Iterations
    "_per_iteration",  # batches in a whole iteration
    "_prepare",  # the Run's preparations at the first next (GPU timing, loader settings)
    "_seen",  # markers.batches.BatchSizes.seen
    "_sizes",  # and its BatchSizes (the C step reads its common case itself)
    "_start_ns",  # when the fetch of the next batch began
    "_state",
    "_suspended",  # this validation loop suspended a training iteration
    "_validation",
)


class PureStep:
    """A loop driver's step in Python: the reference semantics, and the fallback where
    ``markers._speedups`` is not built (``DriverBase`` does the same in C)."""

    __slots__ = SLOTS

    def __iter__(self) -> PureStep:
        return self

    def __next__(self: Any) -> Any:
        state = self._state
        if state != RUNNING:
            if state == DONE:
                raise StopIteration
            self._begin()
        try:
            if state == RUNNING:
                self._fetched_n = -1
                model = self._model
                model.batch_done()
                self._start_ns = start_ns = perf_counter_ns()
                iteration = self._iteration
                if iteration.batches == self._per_iteration:  # the next begins where it ends
                    self._iteration = model.end_full_step(iteration, start_ns)
            batch = next(self._iterator)
            buffer = self._buffer
            buffer.record(self._loading, self._start_ns, perf_counter_ns())
            validation = self._validation
            self._seen(validation, self._counts[validation], self._iteration.batches, batch)
            self._fetched_n, self._fetched_flushes = buffer.n, buffer.flushes
        except StopIteration:
            self._exhausted()
            raise
        except BaseException:
            self._failed()
            raise
        return batch


# The step's slots, as mypy should see them in the mixin (at run time it has none: the
# class it is mixed with holds them).
if TYPE_CHECKING:
    _Slots = PureStep
else:
    _Slots = object


class LoopDriver(_Slots):
    """One loop over ``loader``: ``validation`` or training, ``per_iteration`` batches an
    iteration; ``prepare(loader, validation)`` runs at its first ``next`` (after a validation loop
    suspended the training iteration it runs in). Its step (``__next__``) and slots come
    from the class it is mixed with: ``PureStep`` or ``markers._speedups.DriverBase``."""

    __slots__ = ()

    _buffer: RecordBuffer
    _check_every: int
    _counts: list[int]
    _fetched_flushes: int
    _fetched_n: int
    _iteration: OpenIteration | None
    _iterator: Iterator[Any] | None
    _loader: Iterable[Any] | None
    _loading: int
    _loop_id: int
    _model: Iterations
    _per_iteration: int
    _prepare: Callable[[Iterable[Any], bool], None]
    _seen: Callable[[bool, int, int, Any], None]
    _sizes: BatchSizes
    _start_ns: int
    _state: int
    _suspended: bool
    _validation: bool

    def __init__(
        self,
        model: Iterations,
        buffer: RecordBuffer,
        sizes: BatchSizes,
        loader: Iterable[Any],
        validation: bool,
        per_iteration: int,
        prepare: Callable[[Iterable[Any], bool], None],
    ) -> None:
        self._model, self._buffer = model, buffer
        self._sizes, self._seen = sizes, sizes.seen
        self._loader, self._iterator, self._iteration = loader, None, None
        self._validation = validation
        self._per_iteration = per_iteration
        self._prepare = prepare
        self._counts = model.counts
        self._loading = wire.VALIDATION_DATA_LOADING if validation else wire.TRAINING_DATA_LOADING
        self._loop_id = wire.LOOP_ID[validation]
        self._check_every = GPU_CHECK_EVERY
        self._state = NEW
        self._start_ns = 0
        self._fetched_n = self._fetched_flushes = -1
        self._suspended = False

    def _begin(self) -> None:
        """At the first ``next``: the loop's first iteration begins (its fetch next)."""
        model = self._model
        self._state = DONE  # until the first iteration is open
        self._suspended = self._validation and model.suspend(perf_counter_ns())
        loader, self._loader = self._loader, None
        assert loader is not None  # _state was NEW
        self._prepare(loader, self._validation)
        self._iterator = iter(loader)
        try:
            self._start_ns = perf_counter_ns()
            self._iteration = model.begin_iteration(self._validation, self._start_ns)
        except BaseException:
            self._failed()
            raise
        self._state = RUNNING

    def _exhausted(self) -> None:
        """The loader has no more batches: the last, shorter step ends where the fetch
        that found none began; a step with no batch is no iteration."""
        self._state = DONE
        model, iteration = self._model, self._iteration
        try:
            if iteration is not None and iteration is model.open:
                if iteration.batches:
                    model.end_iteration(self._start_ns)
                else:
                    model.cut_open(self._start_ns)
        finally:
            self._resume()

    def _failed(self) -> None:
        """The loader (or the driver) raised: the iteration being fetched is cut short."""
        self._state = DONE
        model, iteration = self._model, self._iteration
        try:
            if iteration is not None and iteration is model.open:
                model.cut_open(perf_counter_ns())
        finally:
            self._resume()

    def close(self) -> None:
        """Leave the loop (``break``, or an exception in its body). The batch handed out
        went through the network when the body recorded anything after its fetch. An
        iteration holding a batch ends here, whole or cut short as the next primitive
        tells (an epoch, pass or run ending with an exception); one without (left before
        its batch was used) is cut short."""
        if self._state != RUNNING:
            self._state = DONE
            return
        self._state = DONE
        model, buffer, iteration = self._model, self._buffer, self._iteration
        try:
            fetched = (self._fetched_n, self._fetched_flushes)
            if fetched[0] >= 0 and fetched != (buffer.n, buffer.flushes):
                model.batch_done()
            if iteration is not None and iteration is model.open:
                if iteration.batches:
                    model.defer_left_loop(perf_counter_ns())
                else:
                    model.cut_open(perf_counter_ns())
        finally:
            self._resume()

    def __del__(self) -> None:
        # A loop left by ``break`` or an exception: the ``for`` statement let go of it.
        if getattr(self, "_state", DONE) == RUNNING:
            self.close()

    def _resume(self) -> None:
        if self._suspended:
            self._suspended = False
            self._model.resume(perf_counter_ns())


class PureDriver(LoopDriver, PureStep):
    """The loop driver on the Python step."""

    __slots__ = ()


def accelerated_driver() -> type[LoopDriver] | None:
    """The loop driver on the C step, None when ``markers._speedups`` lacks it (not
    built, or built from an older source)."""
    try:
        from markers._speedups import BATCHES_SHIFT, DriverBase
    except ImportError:
        return None
    if wire.BATCHES_SHIFT != BATCHES_SHIFT:
        return None

    class Driver(LoopDriver, DriverBase):
        """The loop driver on the C step."""

        __slots__ = ()

    return Driver


def _driver() -> type[LoopDriver]:
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return PureDriver
    return accelerated_driver() or PureDriver


Driver: type[LoopDriver] = _driver()
ACCELERATED: bool = Driver is not PureDriver
