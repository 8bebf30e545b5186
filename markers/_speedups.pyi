"""markers._speedups (markers/_speedups.c, _driver.c, _iteration.c): the phase marker's,
the loop driver's and the iteration model's hot paths in C, optional."""

from typing import Any, Self

class PhaseBase:
    """What ``markers.phase.PurePhase`` does, in C; ``_buffer`` and ``_id`` read-only."""

    @property
    def _buffer(self) -> Any: ...
    @property
    def _id(self) -> int: ...
    _start: int
    _slot: int
    _depth: int
    def __init__(self, buffer: Any, phase_id: int) -> None: ...
    @property
    def phase_id(self) -> int: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, exc_type: object, exc: object, traceback: object, /) -> None: ...
    def begin(self) -> None: ...
    def end(self) -> None: ...

BATCHES_SHIFT: int  # the loop slot's batch count shift it was built with (markers.wire)

class DriverBase:
    """What ``markers.driver.PureStep`` does, in C: a loop driver's step."""

    _buffer: Any
    _check_every: int
    _counts: Any
    _fetched_flushes: int
    _fetched_n: int
    _iteration: Any
    _iterator: Any
    _loader: Any
    _loading: int
    _loop_id: int
    _model: Any
    _per_iteration: int
    _prepare: Any
    _seen: Any
    _sizes: Any
    _start_ns: int
    _state: int
    _suspended: bool
    _validation: bool
    def __next__(self) -> Any: ...

def end_whole(
    training_loop: int, validation_loop: int, check_every: int, model: Any, end_ns: int, /
) -> None: ...
def begin_training(
    iteration_type: type, loading_id: int, model: Any, start_ns: int, loaded_ns: int, /
) -> None: ...
def batch_done(model: Any, /) -> None: ...
