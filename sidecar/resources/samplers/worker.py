"""One daemon thread that runs calls which may hang, and a bounded wait for each call.

NVML calls have been seen to hang on some drivers. They run here, one at a time (NVML
serialises them in the driver anyway), while the caller waits at most a timeout. A call
that does not return in time is abandoned: the thread stays blocked in it, and because
it is a daemon thread it never keeps the process from exiting. After a timeout the
caller must not submit more work; it would queue behind the stuck call: it may
``stop()`` this worker and start another (``alive`` tells when the stuck call returned).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")


class CallTimeout(Exception):
    """A call on the worker thread did not return within its timeout."""


class Worker:
    """A single daemon thread that executes submitted calls in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller, never lost here
                future.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn()`` on the worker thread; wait for it with ``wait``."""
        future: Future[T] = Future()
        self._jobs.put((future, fn))
        return future

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run ``fn()`` on the worker thread and return its result.

        Waits at most ``timeout_s`` seconds. Raises CallTimeout when the call has not
        returned by then, or whatever ``fn`` raised.
        """
        return wait(self.submit(fn), timeout_s)

    @property
    def alive(self) -> bool:
        """True until the thread has ended (after ``stop()`` and the calls before it)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Ask the thread to end after the calls already queued; does not wait."""
        self._jobs.put(None)


def wait(future: Future[T], timeout_s: float) -> T:
    """The result of a ``submit``, waiting at most ``timeout_s`` seconds (0: only if done).

    Raises CallTimeout when it has not returned by then, or whatever the call raised."""
    try:
        return future.result(timeout=max(0.0, timeout_s))
    except FutureTimeout:
        future.cancel()  # a call still queued is dropped; a running one cannot be
        raise CallTimeout(f"call timed out after {timeout_s:g} s") from None
