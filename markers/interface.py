"""What a training script, a hook or a framework callback may use of a run: declared
once, for ``markers.run.Run`` (monitored) and ``markers.run.NullRun`` (nothing happens).

mypy checks that both classes offer every member (``markers.run``), and a unit test that
``NullRun`` has every public name of ``Run``: a member added to one cannot be forgotten
in the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from markers.phase import NullPhase, Phase


class RunInterface(Protocol):
    """The public surface of a run (``markers.start_run`` returns one)."""

    monitored: bool  # False when no sidecar took the run
    out_dir: Path | None  # the run folder as the sidecar resolved it

    @property
    def phase(self) -> Callable[[str], Phase | NullPhase]:
        """``run.phase(name)``: the marker of phase ``name`` (see ``markers.phase``)."""

    @property
    def dropped(self) -> int:
        """Records that could not be sent so far."""

    @property
    def iteration(self) -> tuple[bool, int] | None:
        """The open iteration as ``(validation, start_ns)``, or None between iterations."""

    @property
    def in_validation(self) -> bool:
        """True between ``begin_validation`` and ``end_validation``."""

    @property
    def last_boundary_ns(self) -> int:
        """When the latest epoch or validation pass began or ended (0 before any)."""

    def epoch(self) -> AbstractContextManager[object]:
        """Context manager around one epoch."""

    def validation(self) -> AbstractContextManager[object]:
        """Context manager around one validation pass."""

    def train_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of ``loader``, training iterations stamped."""

    def val_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of ``loader``, validation iterations stamped."""

    def checkpoint(self, timeout_s: float = ...) -> bool:
        """Have the sidecar write every file and its state now."""

    def state_dict(self, timeout_s: float = ...) -> dict[str, Any]:
        """The sidecar's state of this split."""

    def load_state_dict(self, state: dict[str, Any], timeout_s: float = ...) -> bool:
        """Continue this split from ``state``."""

    def finish(
        self, status: str = ..., error: str | None = ..., loop_ns: tuple[int, int] | None = ...
    ) -> None:
        """End the run."""

    def close_at_exit(self) -> None:
        """At interpreter exit: finish a run left open."""

    def prefer_device(self, device: Any) -> None:
        """The CUDA device to time unless ``start_run(device=...)`` said which."""

    def begin_epoch(self, number: int | None = None) -> None:
        """An epoch starts now (numbered ``number`` when the framework says which)."""

    def end_epoch(self, failed: bool = ...) -> None:
        """The epoch ends now."""

    def begin_validation(self) -> None:
        """A validation pass starts now."""

    def end_validation(self, failed: bool = ...) -> None:
        """The validation pass ends now."""

    def begin_iteration(
        self, validation: bool = ..., start_ns: int | None = ..., explicit_end: bool = ...
    ) -> None:
        """An iteration starts."""

    def exclude_since(self, start_ns: int) -> None:
        """The time since ``start_ns`` belongs to no iteration."""

    def record_phase(self, name: str, start_ns: int, end_ns: int) -> None:
        """Phase ``name`` from ``start_ns`` to ``end_ns``, in the open iteration."""

    def record_outside(self, name: str, start_ns: int, end_ns: int | None = ...) -> None:
        """Custom phase ``name`` from ``start_ns`` to ``end_ns``, in no iteration."""

    def data_loaded(self, start_ns: int, end_ns: int | None = ...) -> None:
        """The open iteration's batch was fetched."""

    def batch_seen(self, validation: bool, batch: Any) -> None:
        """A batch of the open iteration was fetched (its size may be read)."""

    def batch_done(self) -> None:
        """A batch went through the network."""

    def end_iteration(self, end_ns: int | None = ...) -> None:
        """The open iteration ends whole."""

    def leave_iteration(self) -> None:
        """Phases from now on are outside any iteration."""

    def __enter__(self) -> RunInterface:
        """The run itself."""

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: object
    ) -> None:
        """Finish the run (failed when an exception leaves the block)."""
