"""How a process that leaves a run open ends: the status its run gets at interpreter exit.

One rule, the exit status's, with or without ``with run``: an uncaught exception or a
non-zero ``sys.exit`` is ``failed``, a zero one (or the script's end) ``completed``. The
interpreter keeps no exit status where an ``atexit`` handler can read it, so ``sys.exit``
is wrapped once (``watch_exit``) to note the status it was asked for; a ``raise
SystemExit(CODE)`` of the script's own is not seen. An interactive session (a Jupyter
kernel, IPython, ``python -i``) has no such status: an error in one cell is not the end of
the session, so a run still open when it exits is ``incomplete``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = [
    "INTERACTIVE_EXIT",
    "describe",
    "exit_outcome",
    "exit_status_failed",
    "is_interactive",
    "watch_exit",
]

INTERACTIVE_EXIT = "the interactive session ended with the run open (no finish())"

# The status ``sys.exit`` was last asked for, as SystemExit's code (None: not called).
_requested: list[object] = []


def _watching(original: Callable[..., NoReturn]) -> Callable[..., NoReturn]:
    def exit(status: object = None, /) -> NoReturn:
        _requested[:] = [status]
        original(status)

    exit.__doc__ = original.__doc__
    exit.__wrapped__ = original  # type: ignore[attr-defined]
    return exit


def watch_exit() -> None:
    """Wrap ``sys.exit`` (once per process) so the status it is asked for is known at exit."""
    if not hasattr(sys.exit, "__wrapped__"):
        sys.exit = _watching(sys.exit)


def is_interactive() -> bool:
    """True in an interactive session: an IPython shell or Jupyter kernel, or the plain
    interpreter's prompt (``python -i``, or ``python`` reading a terminal)."""
    ipython: Any = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if callable(get_ipython) and get_ipython() is not None:
        return True
    return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, or ``Type`` alone when it has no message (a
    KeyboardInterrupt): the cause a failed run's files give."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def exit_status_failed(code: object) -> bool:
    """Whether SystemExit's ``code`` makes a non-zero exit status (None and 0 do not;
    any other object, printed as a message, exits 1)."""
    return code is not None and code != 0


def exit_outcome(interactive: bool) -> tuple[str, str | None]:
    """The (status, cause) of a run still open at interpreter exit: ``interactive`` (as
    ``is_interactive`` said while the session ran) gives ``incomplete``; else the uncaught
    exception the interpreter recorded, then the status ``sys.exit`` was asked for."""
    if interactive:
        return "incomplete", INTERACTIVE_EXIT
    last = getattr(sys, "last_value", None)
    if isinstance(last, BaseException):
        return "failed", describe(last)
    if _requested and exit_status_failed(_requested[0]):
        return "failed", describe(SystemExit(_requested[0]))
    return "completed", None
