"""What an NVML failure means for the next rounds: per GPU and per call, never more.

``classify`` sorts any exception a call raised:

* ``"lost"``: the GPU is gone (``GPU_IS_LOST``, ``RESET_REQUIRED``, ``GPU_NOT_FOUND``);
  it is skipped from then on.
* ``"permanent"``: the call cannot work on this GPU (``NOT_SUPPORTED``,
  ``NO_PERMISSION``, ``FUNCTION_NOT_FOUND``, ``ARGUMENT_VERSION_MISMATCH``,
  ``INVALID_ARGUMENT``, pynvml's ``NVMLLibraryMismatchError``, a value of a type we do not
  know, or any exception that is not an NVMLError: a binding that does not fit the
  driver); that call is switched off for that GPU.
* ``"transient"``: anything else (``UNKNOWN``, ``TIMEOUT``, ``INSUFFICIENT_RESOURCES``,
  a call that did not return in time, ...); the call is retried with backoff.

``CallGuard`` keeps that state for one GPU: calls off for good (with why) and calls
waiting for their retry round (1, 2, 4, ... up to ``MAX_BACKOFF_ROUNDS`` rounds after
each consecutive failure; a call that did not return in time starts at 4). A success
clears the backoff.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_BACKOFF_ROUNDS = 64

_LOST = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_GPU_NOT_FOUND")
_PERMANENT = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    "NVML_ERROR_INVALID_ARGUMENT",
)


class BadValue(Exception):
    """NVML answered with a value this sampler cannot read (an unknown value type)."""


def classify(api: Any, exc: BaseException) -> str:
    """``"lost"``, ``"permanent"`` or ``"transient"`` for an exception an NVML call
    raised (see the module docstring)."""
    if isinstance(exc, api.NVMLError):
        code = exc.value
        if code in {getattr(api, name, None) for name in _LOST}:
            return "lost"
        if code in {getattr(api, name, None) for name in _PERMANENT}:
            return "permanent"
        return "transient"
    if isinstance(exc, TimeoutError):
        return "transient"
    return "permanent"  # NVMLLibraryMismatchError, BadValue, a binding that does not fit


@dataclass
class CallGuard:
    """Which calls of one GPU are off for good, and which wait for a retry round."""

    off: dict[str, str] = field(default_factory=dict)  # call -> why it is not made
    waiting: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    # call -> (round of the next try, consecutive failures, last error)

    def allowed(self, call: str, round_no: int) -> bool:
        """Whether ``call`` is to be made in round ``round_no``."""
        if call in self.off:
            return False
        wait = self.waiting.get(call)
        return wait is None or round_no >= wait[0]

    def succeeded(self, call: str) -> None:
        if self.waiting:  # made after every call that answered: mostly nothing waits
            self.waiting.pop(call, None)

    def failed(self, call: str, kind: str, reason: str, round_no: int, weight: int = 1) -> None:
        """Note a failure of kind ``"permanent"`` or ``"transient"`` in ``round_no``;
        ``weight`` counts it as that many failures (a call that did not return in time
        costs a stuck thread: it waits longer before its next try)."""
        if kind == "permanent":
            self.off[call] = reason
            self.waiting.pop(call, None)
            return
        failures = self.waiting.get(call, (0, 0, ""))[1] + weight
        self.waiting[call] = (
            round_no + min(2 ** (failures - 1), MAX_BACKOFF_ROUNDS),
            failures,
            reason,
        )

    def retrying(self) -> dict[str, str]:
        """For status: the calls waiting for a retry, with their last error."""
        return {
            call: f"{reason} (retry in round {at}, failure {n})"
            for call, (at, n, reason) in self.waiting.items()
        }
