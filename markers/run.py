"""A monitored run: its lifecycle (checkpoints, state, finish) and the loop drivers
(``train_batches``, ``val_batches``) of one split.

The parts it is made of: the phase markers and their table (``markers.phase``; the hot
path), the iteration model (``markers.iteration``, which ``Run`` owns and drives), the
batch sizes read from the batches (``markers.batches``) and the record buffer
(``markers.buffer``). The buffer goes out at epoch ends, checkpoints and finish besides
its own batches. Nothing here waits on the GPU or raises into the loop. The public
surface is declared once in ``markers.interface``.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from markers import forks, wire
from markers.batches import BatchSizes
from markers.buffer import GPU_DRAIN_S, RecordBuffer
from markers.driver import Driver
from markers.exits import describe, exit_outcome, exit_status_failed, is_interactive
from markers.iteration import Iterations, Span
from markers.loaders import loader_control
from markers.phase import NULL_PHASE, GpuPhase, NullPhase, Phase, PhaseTable
from markers.transport import Sender

if TYPE_CHECKING:
    from markers.interface import RunInterface

FINISH_TIMEOUT_S = 10.0
CHECKPOINT_TIMEOUT_S = 5.0
STATE_TIMEOUT_S = 5.0

__all__ = ["GpuPhase", "NullRun", "Phase", "Run", "describe"]


class Run:
    """One monitored training run of one split (created by ``markers.start_run``).

    The iteration model (docs/iteration-model.md) lives in the primitives: an iteration
    runs from fetching its batch to fetching the next (or leaving the loop); every
    iteration that holds anything ends with exactly one loop record, complete or flagged
    incomplete, so nothing of it can move into a later one.

    ``run.phase(name)`` returns the marker of phase ``name``: a canonical one (forward,
    backward, optimization, evaluation, metrics) or a custom name, which gets its own
    column (tabs and newlines in it become spaces). A custom name equal to a standard
    label in any case (``Forward``, ``Epoch``, ``Training loop``, ...) is refused with one
    RuntimeWarning and measures nothing. Use it as a context manager or a decorator; the
    same object is returned each time.
    """

    def __init__(
        self,
        sender: Sender,
        hello: dict[str, Any],
        monitored: bool,
        on_close: Callable[[], None] | None = None,
        first_epoch: int = 0,
        device: Any = None,
    ) -> None:
        self._sender = sender
        self._device = device  # start_run's device=: what GPU timing should time
        self.monitored = monitored
        self.out_dir: Path | None = None  # the run folder as the sidecar resolved it
        self._on_close = on_close
        self._accumulation = int(hello["accumulation_steps"])
        self._sizes = BatchSizes(sender, hello)
        self._buffer = RecordBuffer(sender, hello, perf_counter_ns())
        self._phases = PhaseTable(self._buffer)
        # run.phase(name) is written inside the loop, so it is the table's own C lookup
        # (no Python frame): a known name costs a dict hit, a new one calls __missing__.
        self.phase: Callable[[str], Phase | NullPhase] = self._phases.__getitem__
        self._iter = Iterations(self._buffer, first_epoch, self._open_gpu)
        self._epoch_iterations = 0  # iterations of both kinds when the open epoch began
        self._told_no_iterations = False  # the warning about phases without iterations
        self._finished = False
        # Known while the session runs: at a kernel's exit its shell may be gone already.
        self._interactive = is_interactive()
        forks.on_fork(self, Run._before_fork, Run._enter_child)

    # -- public API -----------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Records that could not be sent so far (sidecar absent or slow)."""
        return self._sender.dropped

    def epoch(self) -> Span:
        """Context manager around one epoch (the Epoch column); an exception leaving it
        keeps the epoch in phases.tsv flagged incomplete."""
        return Span(self._iter.begin_epoch, self._iter.end_epoch)

    def validation(self) -> Span:
        """Context manager around one validation pass (the Validation column). Inside a
        training iteration it suspends that iteration: its Training loop time excludes
        the pass."""
        return Span(self._iter.begin_validation, self._iter.end_validation)

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
        self._iter.settle_left_loops()
        start_ns = perf_counter_ns()
        self._send_buffered(timeout_s)
        reply = self._sender.request({"type": wire.CHECKPOINT}, timeout_s)
        self._iter.exclude_since(start_ns)
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
        self._iter.settle_left_loops()
        start_ns = perf_counter_ns()
        self._send_buffered(timeout_s)
        reply = self._sender.request({"type": wire.STATE}, timeout_s)
        self._iter.exclude_since(start_ns)
        state = reply.get("state") if reply and reply.get("ok") else None
        if not isinstance(state, dict):
            if self.monitored:  # an empty dict means nothing was saved: say why
                reason = reply.get("error") if reply else self._sender.last_failure
                warnings.warn(
                    f"markers: state_dict() got no state ({reason})", RuntimeWarning, stacklevel=2
                )
            return {}
        return state

    def load_state_dict(self, state: dict[str, Any], timeout_s: float = STATE_TIMEOUT_S) -> bool:
        """Continue this split from ``state`` (from ``state_dict()`` of an earlier process):
        the same as ``start_run(resume=True)`` with the state kept by the user. Call it
        before the first epoch. Epochs continue from the saved ones. A state of any size
        is sent in parts. Waits at most ``timeout_s`` seconds without progress; True when
        the sidecar took the state, False (with one RuntimeWarning saying why) otherwise.
        Never raises.
        """
        if not state:
            return False
        self._iter.settle_left_loops()
        self._send_buffered(timeout_s)
        try:
            payload = json.dumps(state, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            reply: dict[str, Any] | None = {"error": f"the state is not JSON-compatible: {exc}"}
        else:  # any size: it travels in parts (``wire.PART_BYTES``)
            reply = self._sender.request(
                {"type": wire.LOAD_STATE, "payload_bytes": len(payload)}, timeout_s, payload=payload
            )
        if not (reply and reply.get("ok")):
            reason = reply.get("error") if reply else self._sender.last_failure
            warnings.warn(
                f"markers: saved state not loaded ({reason})", RuntimeWarning, stacklevel=2
            )
            return False
        epoch = reply.get("epoch")
        if isinstance(epoch, int):
            self._iter.epoch = epoch
            self._iter.set_outside()
        return True

    def _send_buffered(self, timeout_s: float) -> None:
        """Before a request: send what is buffered. A send queue left full by a fast loop
        (the sidecar still reading its backlog) is waited on first, at most ``timeout_s``
        seconds, so these last records are not dropped."""
        self._sender.wait_for_room(timeout_s)
        self._buffer.flush()

    def finish(
        self,
        status: str = "completed",
        error: str | None = None,
        loop_ns: tuple[int, int] | None = None,
    ) -> None:
        """End the run: send everything (waiting at most ``GPU_DRAIN_S`` for GPU times
        still in flight), have the sidecar write its files (waiting as long as it reports
        progress on them, and at most ``FINISH_TIMEOUT_S`` without), close the connection.
        Safe to call more than once. One RuntimeWarning when the sidecar did not answer or
        could not write the files (it names the sidecar's error). ``status``:
        ``completed``, ``failed``, or ``incomplete`` (cut short, not by an error: Ctrl-C
        where the framework ends without telling its callbacks).

        An iteration, epoch or validation pass still open is cut short: kept in phases.tsv
        flagged incomplete (an iteration left by a loop's ``break`` before a completed
        finish is whole).

        ``loop_ns``: when a framework times its own training loop (the Trainer's
        ``train_runtime``), that loop's start and end (``perf_counter_ns``): summary.log
        names the Training time before and after it.
        """
        if self._finished:
            return
        self._finished = True
        end_ns = perf_counter_ns()
        self._iter.close_all(status != "completed", end_ns)
        self._tell_if_no_iterations(0)
        if self._buffer.gpu is not None:
            self._buffer.drain_gpu()
        self._send_buffered(FINISH_TIMEOUT_S)
        worker_phases = self._buffer.children.collect()
        if worker_phases:
            warnings.warn(
                f"markers: {worker_phases} phases inside DataLoader workers were not "
                "measured (a worker process cannot send; time them in the main "
                "process)",
                RuntimeWarning,
                stacklevel=2,
            )
        unfinished = self._buffer.gpu_unfinished
        if unfinished:
            warnings.warn(
                f"markers: {unfinished} phases have no GPU time: the GPU was still "
                f"running earlier work when the wait at finish ended "
                f"({GPU_DRAIN_S:g} s)",
                RuntimeWarning,
                stacklevel=2,
            )
        reply = self._sender.request(
            {
                "type": wire.FINISH,
                "status": status,
                "error": error,
                "end_ns": end_ns,
                "worker_phases": worker_phases,
                "gpu_unfinished": unfinished,
                **(
                    {"loop_start_ns": loop_ns[0], "loop_end_ns": loop_ns[1]}
                    if loop_ns is not None
                    else {}
                ),
            },
            FINISH_TIMEOUT_S,
        )
        if reply is None:
            warnings.warn(
                "markers: the sidecar did not confirm writing the files "
                f"({self._sender.last_failure})",
                RuntimeWarning,
                stacklevel=2,
            )
        elif not reply.get("ok"):  # it answered, but its files are not there: say so here
            warnings.warn(
                f"markers: the sidecar could not write the files ({reply.get('error')}"
                "); its log and `sidecar status` say more",
                RuntimeWarning,
                stacklevel=2,
            )
        self._sender.close()
        self._buffer.children.close()
        if self._on_close is not None:
            self._on_close()

    def close_at_exit(self) -> None:
        """At interpreter exit: a run left open is finished by the process's exit status
        (``markers.exits``): failed after an uncaught exception or a non-zero
        ``sys.exit``, else completed; ``incomplete`` in an interactive session."""
        if not self._finished:
            self.finish(*exit_outcome(self._interactive or is_interactive()))

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object
    ) -> None:
        if exc is None or (isinstance(exc, SystemExit) and not exit_status_failed(exc.code)):
            self.finish("completed")  # sys.exit(0) is a normal end
        else:
            self.finish("failed", describe(exc))

    # -- primitives: loop helpers, module hooks and framework callbacks drive these -----

    def begin_epoch(self, number: int | None = None) -> None:
        """An epoch starts now (an epoch still open is cut short). ``number``: the
        framework's own count (0 first), for a framework whose resume goes on from a
        later epoch than the one open at its checkpoint; else the next after the last."""
        self._iter.begin_epoch(number)
        self._epoch_iterations = sum(self._iter.counts)

    def end_epoch(self, failed: bool = False) -> None:
        """The epoch begun by ``begin_epoch`` ends now: one Epoch measurement, or, when
        ``failed`` (cut short by an exception or a signal), a row flagged incomplete. An
        iteration still open ends with it. The next phases belong to the next epoch;
        sends what is buffered."""
        self._iter.end_epoch(failed)
        self._tell_if_no_iterations(self._epoch_iterations)

    def begin_validation(self) -> None:
        """A validation pass starts now. Inside a training iteration the pass suspends it:
        the pass is its own Validation measurement and the iteration's loop time
        excludes it."""
        self._iter.begin_validation()

    def end_validation(self, failed: bool = False) -> None:
        """The validation pass ends now: one Validation measurement (flagged incomplete
        when ``failed``); a training iteration it (or a validation iteration begun inside
        it) suspended goes on."""
        self._iter.end_validation(failed)

    def begin_iteration(
        self, validation: bool = False, start_ns: int | None = None, explicit_end: bool = False
    ) -> None:
        """A training (or validation) iteration starts at ``start_ns`` (perf_counter_ns;
        default now): the phases that follow belong to it. With accumulation, one training
        iteration is one optimization step. An iteration of the same kind still open is cut
        short (flagged incomplete); a validation iteration inside a training one suspends
        it. With ``explicit_end`` only ``end_iteration`` ends it whole: the end of an epoch,
        a pass or the run cuts it short (hooks that end it at the optimizer step: trailing
        micro-batches that never step are no whole iteration)."""
        self._iter.begin_iteration(validation, start_ns, explicit_end)

    def data_loaded(self, start_ns: int, end_ns: int | None = None) -> None:
        """The open iteration's batch was fetched from ``start_ns`` to ``end_ns`` (default
        now; perf_counter_ns): one Training (or Validation) data loading phase."""
        self._iter.data_loaded(start_ns, end_ns)

    def batch_seen(self, validation: bool, batch: Any) -> None:
        """A batch of the open iteration was fetched: its size is read (when ``start_run``
        was not given it), once per batch, and sent when it changed."""
        model = self._iter
        position = model.open.batches if model.open is not None else 0
        self._sizes.seen(validation, model.counts[validation], position, batch)

    def batch_done(self) -> None:
        """A batch went through the network (counts towards warmup and towards the
        batches of the open iteration, which throughput counts)."""
        self._iter.batch_done()

    def end_iteration(self, end_ns: int | None = None) -> None:
        """The open iteration ends at ``end_ns`` (default now): one Training (or Validation)
        loop measurement holding the batches it really held. Without an open iteration,
        nothing happens. Phases after it are outside any iteration until the next one."""
        self._iter.end_iteration(end_ns)

    def leave_iteration(self) -> None:
        """Phases from now on are outside any iteration; an iteration still open is cut
        short: kept in phases.tsv flagged incomplete, never measured."""
        self._iter.leave_iteration()

    def exclude_since(self, start_ns: int) -> None:
        """The time since ``start_ns`` (perf_counter_ns; a framework's checkpoint save)
        belongs to no iteration: the open one's loop time leaves it out."""
        self._iter.exclude_since(start_ns)

    def record_phase(self, name: str, start_ns: int, end_ns: int) -> None:
        """Phase ``name`` from ``start_ns`` to ``end_ns`` (perf_counter_ns), in the open
        iteration, with no GPU time: for a phase whose kind is known only after it ran."""
        marker = self._phases[name]
        if isinstance(marker, Phase):
            self._buffer.record(marker.phase_id, start_ns, end_ns)

    def record_outside(self, name: str, start_ns: int, end_ns: int | None = None) -> None:
        """Custom phase ``name`` from ``start_ns`` to ``end_ns`` (perf_counter_ns; None:
        now), outside any iteration whatever is open (a framework's checkpoint save: its
        own measurement, in phases.tsv and the summary)."""
        marker = self._phases[name]
        if isinstance(marker, Phase):
            self._iter.record_outside(
                marker.phase_id, start_ns, perf_counter_ns() if end_ns is None else end_ns
            )

    def _tell_if_no_iterations(self, since: int) -> None:
        """Warn once when phases were stamped but no iteration was measured since
        ``since`` (iterations counted at an epoch's begin, or 0 for the run): the natural
        first try of ``run.phase`` inside ``run.epoch()`` without a loop driver writes an
        empty table. A warning rather than rows guessed from the phase sequence: where a
        batch's fetch begins and what ends an iteration are the script's to say."""
        if (
            self._told_no_iterations
            or sum(self._iter.counts) != since
            or not any(isinstance(marker, Phase) for marker in self._phases.values())
        ):
            return
        self._told_no_iterations = True
        warnings.warn(
            "markers: phases were stamped but no iteration was measured: wrap the "
            "loader in run.train_batches(...) (run.val_batches(...) for "
            "evaluation), or call markers.instrument(model, optimizer). Until "
            "then the phases are only in phases.tsv, flagged outside, and the "
            "table is empty",
            RuntimeWarning,
            stacklevel=3,
        )

    # -- what hooks and callbacks read to agree with the loop drivers -----------------

    @property
    def iteration(self) -> tuple[bool, int] | None:
        """The open iteration as ``(validation, start_ns)``, or None between iterations."""
        it = self._iter.open
        return (it.validation, it.start_ns) if it is not None else None

    @property
    def in_validation(self) -> bool:
        """True between ``begin_validation`` and ``end_validation``."""
        return self._iter.in_validation

    @property
    def last_boundary_ns(self) -> int:
        """When the latest epoch or validation pass began or ended (perf_counter_ns; 0
        before any): time before it belongs to no iteration that starts after it."""
        return self._iter.boundary_ns

    # -- loop drivers ---------------------------------------------------------------

    def _batches(self, loader: Iterable[Any], validation: bool) -> Iterator[Any]:
        """The loop driver over ``loader`` (``markers.driver``)."""
        return Driver(
            self._iter,
            self._buffer,
            self._sizes,
            loader,
            validation,
            1 if validation else self._accumulation,
            self._prepare_loop,
        )

    def _prepare_loop(self, loader: Iterable[Any], validation: bool) -> None:
        """At a loop's first batch: CUDA may have come up since the last loop; the
        loader's settings go to the report's advice on input-bound steps."""
        self._open_gpu()
        settings = loader_control(loader, validation)
        if settings is not None:
            self._sender.send_control(settings)

    def _before_fork(self) -> None:
        if not self._finished:
            self._buffer.children.before_fork()

    def _enter_child(self) -> None:
        """In a forked child (a DataLoader worker): this process cannot send; its phases
        are counted for the parent, on the CPU path, and the child never finishes the
        run."""
        self._finished = True
        self._buffer.enter_child()
        self._phases.enter_child()

    def prefer_device(self, device: Any) -> None:
        """Time the CUDA device ``device`` names (a module: where its parameters are) when
        GPU timing starts, unless ``start_run(device=...)`` already said which."""
        if self._device is None:
            self._device = device

    def _open_gpu(self) -> None:
        """Start GPU timing once the script uses CUDA (checked at loop starts and every
        ``markers.iteration.GPU_CHECK_EVERY`` steps until then; a CPU-only run never
        touches torch.cuda), on the device ``markers.cuda.choose_device`` picks."""
        if self._buffer.gpu is not None or "torch" not in sys.modules:
            return
        from markers.gpu import open_gpu_timer

        timer = open_gpu_timer(device=self._device)
        if timer is not None:
            self._buffer.use_gpu(timer)
            self._phases.use_gpu()
            self._sender.send_control(
                {"type": wire.GPU, "uuid": timer.device_uuid, "name": timer.device_name}
            )


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

    def phase(self, name: str) -> NullPhase:
        """A marker that measures nothing."""
        return NULL_PHASE

    def epoch(self) -> NullPhase:
        """A context manager that measures nothing."""
        return NULL_PHASE

    validation = epoch

    def train_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of ``loader``, unchanged."""
        return iter(loader)

    val_batches = train_batches

    def begin_iteration(
        self, validation: bool = False, start_ns: int | None = None, explicit_end: bool = False
    ) -> None:
        """Does nothing."""

    def exclude_since(self, start_ns: int) -> None:
        """Does nothing."""

    def record_phase(self, name: str, start_ns: int, end_ns: int) -> None:
        """Does nothing."""

    def record_outside(self, name: str, start_ns: int, end_ns: int | None = None) -> None:
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
    batch_done = leave_iteration = close_at_exit = prefer_device = _nothing

    def checkpoint(self, timeout_s: float = CHECKPOINT_TIMEOUT_S) -> bool:
        """Nothing is written: False."""
        return False

    def state_dict(self, timeout_s: float = STATE_TIMEOUT_S) -> dict[str, Any]:
        """No state: an empty dict (loading it later is a no-op)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], timeout_s: float = STATE_TIMEOUT_S) -> bool:
        """Nothing is loaded: False."""
        return False

    def finish(
        self,
        status: str = "completed",
        error: str | None = None,
        loop_ns: tuple[int, int] | None = None,
    ) -> None:
        """Does nothing."""

    def __enter__(self) -> NullRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None


if TYPE_CHECKING:  # mypy checks here that both runs offer every member of the interface
    _RUNS: tuple[type[RunInterface], ...] = (Run, NullRun)
