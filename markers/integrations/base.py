"""What the framework callbacks share: starting the run from the callback's keyword
arguments and the framework's settings, driving the ``Run`` primitives from the
framework's events (one phase open at a time), and never raising into the trainer.

Importing this module imports no framework.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, TypeVar

from markers.phase import NullPhase, Phase
from markers.run import NullRun, Run
from markers.start import start_run

log = logging.getLogger("markers.integrations")
F = TypeVar("F", bound=Callable[..., Any])

# The callbacks take exactly start_run's keyword arguments: read from it, never copied.
START_RUN_KEYWORDS = frozenset(inspect.signature(start_run).parameters)
CHECKPOINT_PHASE = "checkpoint"  # the custom phase of a framework's checkpoint saves


def never_raise(method: F) -> F:
    """A callback method that never raises into the trainer: the first error is logged
    (with its traceback) and the monitor stops measuring; training goes on."""

    @functools.wraps(method)
    def guarded(self: Monitor, *args: Any, **kwargs: Any) -> Any:
        if self.broken:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception:
            self.broken = True
            log.exception(
                "markers: the %s callback failed in %s; monitoring stops, training goes on",
                type(self).__name__,
                method.__name__,
            )
            return None

    return guarded  # type: ignore[return-value]


class Monitor:
    """The state of a framework callback: its run and the phase open now.

    ``start_run_kwargs`` are ``markers.start_run``'s keyword arguments; those not given
    are read from the framework when the run starts (``start``).
    """

    def __init__(self, **start_run_kwargs: Any) -> None:
        unknown = set(start_run_kwargs) - START_RUN_KEYWORDS
        if unknown:
            raise TypeError(
                f"MonitorCallback: unknown keyword arguments {sorted(unknown)}; "
                f"it takes those of markers.start_run: {sorted(START_RUN_KEYWORDS)}"
            )
        self.start_run_kwargs = start_run_kwargs
        self.run: Run | NullRun = NullRun()
        self.broken = False
        self._started = False
        self._current: Phase | NullPhase | None = None  # the phase the events opened
        self._last_end_ns = perf_counter_ns()  # end of the latest batch, save or pass

    def start(self, **framework: Any) -> None:
        """Start the run: the callback's keyword arguments, else the framework's values."""
        if self._started:
            return
        self._started = True
        given = {k: v for k, v in framework.items() if v is not None}
        self.run = start_run(**{**given, **self.start_run_kwargs})

    def finish(
        self,
        status: str = "completed",
        error: str | None = None,
        loop_ns: tuple[int, int] | None = None,
    ) -> None:
        """End the run (the sidecar writes the files); safe to call more than once.
        ``loop_ns``: the framework's own training loop, start and end (``Run.finish``)."""
        self.switch(None)
        self.run.finish(status, error, loop_ns)

    def switch(self, name: str | None) -> None:
        """End the open phase and begin ``name`` (none when None)."""
        if self._current is not None:
            self._current.end()
        self._current = self.run.phase(name) if name is not None else None
        if self._current is not None:
            self._current.begin()

    def begin_batch(self, validation: bool, batch: Any = None) -> None:
        """A batch starts now: the iteration opens (when none is) at the end of the
        previous batch, and the time since then is its data loading."""
        run = self.run
        now_ns = perf_counter_ns()
        start = max(self._last_end_ns, run.last_boundary_ns)
        if run.iteration is None:
            run.begin_iteration(validation, start)
        run.data_loaded(start, now_ns)
        if batch is not None:
            run.batch_seen(validation, batch)

    def end_batch(self, end_iteration: bool) -> None:
        """The batch ends now; with ``end_iteration`` its iteration too."""
        self.switch(None)
        self.run.batch_done()
        if end_iteration:
            self.run.end_iteration()
        self.mark()

    def cut_out(self, start_ns: int) -> None:
        """The time since ``start_ns`` (a checkpoint save) belongs to no iteration and to
        no batch's data loading: it is its own phase, ``checkpoint``."""
        self.run.exclude_since(start_ns)
        self.run.record_outside(CHECKPOINT_PHASE, start_ns)
        self.mark()

    def mark(self) -> None:
        """Time before now belongs to no later batch's data loading (a checkpoint write)."""
        self._last_end_ns = perf_counter_ns()
