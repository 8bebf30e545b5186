"""``MonitorHandler`` for MONAI's engines (``SupervisedTrainer``, ``SupervisedEvaluator``)
and plain Ignite engines:

    MonitorHandler(warmup_iterations=10).attach(trainer, evaluator=evaluator)

Attach it after the engines are built (MONAI attaches their handlers then: the evaluator's
metrics, the trainer's ``ValidationHandler``), so that its handlers of an event run after
theirs: an epoch holds the validation run at its end, an evaluation batch its metric
updates.

From Ignite's events, per training batch:

* Training data loading: the previous batch's end (or the epoch's start) →
  ``GET_BATCH_COMPLETED``;
* where the engine fires MONAI's ``IterationEvents`` (``SupervisedTrainer``): Forward
  ``ITERATION_STARTED`` → ``LOSS_COMPLETED`` (the batch's move to the device and the loss
  included), Backward → ``BACKWARD_COMPLETED``, Optimization → ``MODEL_COMPLETED`` on
  batches that step (MONAI's own ``MODEL_COMPLETED`` handlers, decollation and
  post-processing, come first and are included). A plain Ignite engine fires none of
  those: its process function is in the Training loop only. Nor does a MONAI trainer
  with a custom ``iteration_update`` (or ``_iteration``) that fires none: its first
  iteration shows it, Forward, Backward and Optimization stay empty and one warning says
  what to do (fire the events from the step, or mark the phases in it). The first
  iteration's Forward is known to be one only at ``LOSS_COMPLETED``: stored without its
  GPU time;
* an iteration (Training loop) ends at ``ITERATION_COMPLETED`` of the batch that steps
  the optimizer (``accumulation_steps`` of a ``SupervisedTrainer``, with its flush at the
  end of the epoch);
* Epoch: ``EPOCH_STARTED`` → ``EPOCH_COMPLETED``, numbered as Ignite counts.

The evaluator's runs inside the training run are Validation (``STARTED`` →
``COMPLETED``), each batch an iteration: data loading up to ``GET_BATCH_COMPLETED``,
Evaluation ``ITERATION_STARTED`` → ``MODEL_COMPLETED`` (or the iteration's end), Metrics
computation → ``ITERATION_COMPLETED`` (the metrics' updates).

The run starts at the trainer's ``STARTED`` with the handler's keyword arguments (those of
``markers.start_run``); not given: ``accumulation_steps`` the trainer's, batch sizes read
from the batches (MONAI's dict batches). It ends at ``COMPLETED``; at
``EXCEPTION_RAISED`` the files are written marked failed (a KeyboardInterrupt:
incomplete), and the exception goes on unless another handler of that event takes it:
Ignite swallows an exception that has handlers. The handler has ``state_dict`` and
``load_state_dict``, so Ignite's ``Checkpoint`` saves it beside the model and
``Checkpoint.load_objects`` (before ``trainer.run``) continues the split.
"""

from __future__ import annotations

import warnings
from time import perf_counter_ns
from typing import Any

from ignite.engine import Engine, Events

from markers.integrations.base import Monitor, never_raise
from markers.run import describe

NO_ITERATION_EVENTS = (
    "markers: the trainer's iteration fired none of MONAI's IterationEvents (a custom "
    "iteration_update or process function): Forward, Backward and Optimization stay "
    "empty, the step is in the Training loop only. Fire them from the step "
    "(engine.fire_event(IterationEvents.LOSS_COMPLETED), BACKWARD_COMPLETED, "
    "MODEL_COMPLETED, as SupervisedTrainer does), or mark the phases in the step "
    "(with handler.run.phase('forward'): ... in it)"
)


class MonitorHandler(Monitor):
    """Monitors an Ignite trainer (and its evaluator): takes ``markers.start_run``'s
    keyword arguments."""

    def __init__(self, **start_run_kwargs: Any) -> None:
        super().__init__(**start_run_kwargs)
        self._saved: dict[str, Any] | None = None  # a state loaded before the run started
        self._validating = False
        self._training = False  # between the trainer's STARTED and its end
        # Whether the trainer's step fires MONAI's IterationEvents: None until an iteration
        # shows it (a custom iteration_update registers them but may fire none).
        self._fires: bool | None = None
        self._fired = False  # LOSS_COMPLETED came in the open iteration
        self._iteration_start_ns = 0

    def attach(self, trainer: Engine, evaluator: Engine | None = None) -> MonitorHandler:
        """Attach to ``trainer`` and, when given, to ``evaluator`` (whose runs during
        training are its validation passes). Returns the handler."""
        on = trainer.add_event_handler
        on(Events.STARTED, self._on_started)
        on(Events.EPOCH_STARTED, self._on_epoch_started)
        on(Events.GET_BATCH_COMPLETED, self._on_batch_loaded, False)
        on(Events.ITERATION_COMPLETED, self._on_iteration_completed)
        on(Events.EPOCH_COMPLETED, self._on_epoch_completed)
        on(Events.COMPLETED, self._on_completed)
        on(Events.EXCEPTION_RAISED, self._on_exception_raised)
        monai = _monai_events(trainer)
        if monai is not None:
            on(Events.ITERATION_STARTED, self._on_iteration_started)
            on(monai.LOSS_COMPLETED, self._on_loss_completed)
            on(monai.BACKWARD_COMPLETED, self._on_backward_completed)
            on(monai.MODEL_COMPLETED, self._on_switch, None)
        if evaluator is not None:
            on = evaluator.add_event_handler
            on(Events.STARTED, self._on_validation_started)
            on(Events.GET_BATCH_COMPLETED, self._on_batch_loaded, True)
            on(Events.ITERATION_STARTED, self._on_evaluating, "evaluation")
            monai = _monai_events(evaluator)
            if monai is not None:
                on(monai.MODEL_COMPLETED, self._on_evaluating, "metrics")
            on(Events.ITERATION_COMPLETED, self._on_validation_batch_completed)
            on(Events.COMPLETED, self._on_validation_completed)
            on(Events.EXCEPTION_RAISED, self._on_exception_raised)
        return self

    # -- state: Ignite's Checkpoint -------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, for Ignite's ``Checkpoint`` (plain containers)."""
        try:
            return self.run.state_dict()
        except Exception:  # never into the trainer: a checkpoint without our state
            return {}

    @never_raise
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the split from ``state_dict`` (``Checkpoint.load_objects``, before
        ``trainer.run``): loaded when the run starts, or at once when it has."""
        if self._training:
            self.run.load_state_dict(dict(state_dict))
        else:
            self._saved = dict(state_dict)

    # -- the trainer ----------------------------------------------------------------

    @never_raise
    def _on_started(self, engine: Engine) -> None:
        self.start(accumulation_steps=getattr(engine, "accumulation_steps", None))
        self._training = True
        if self._saved:
            self.run.load_state_dict(self._saved)
            self._saved = None

    @never_raise
    def _on_epoch_started(self, engine: Engine) -> None:
        self.run.begin_epoch(engine.state.epoch - 1)

    @never_raise
    def _on_batch_loaded(self, engine: Engine, validation: bool) -> None:
        if validation and not self._validating:
            return
        self.begin_batch(validation, engine.state.batch)

    @never_raise
    def _on_switch(self, engine: Engine, name: str | None) -> None:
        self.switch(name)

    @never_raise
    def _on_iteration_started(self, engine: Engine) -> None:
        self._fired = False
        self._iteration_start_ns = perf_counter_ns()
        if self._fires:
            self.switch("forward")

    @never_raise
    def _on_loss_completed(self, engine: Engine) -> None:
        self._fired = True
        if not self._fires:
            # Known to be a Forward only now that its end came: without its GPU time.
            self.run.record_phase("forward", self._iteration_start_ns, perf_counter_ns())
            self._fires = True
        self.switch("backward")

    @never_raise
    def _on_backward_completed(self, engine: Engine) -> None:
        self.switch("optimization" if _steps(engine) else None)

    @never_raise
    def _on_iteration_completed(self, engine: Engine) -> None:
        if self._fires is None and not self._fired and _monai_events(engine) is not None:
            self._fires = False
            warnings.warn(NO_ITERATION_EVENTS, UserWarning, stacklevel=2)
        self.end_batch(_steps(engine))

    @never_raise
    def _on_epoch_completed(self, engine: Engine) -> None:
        self.run.end_epoch()

    @never_raise
    def _on_completed(self, engine: Engine) -> None:
        self._training = False
        self.finish()

    def _on_exception_raised(self, engine: Engine, exception: BaseException) -> None:
        """The files are written, marked failed (incomplete for a KeyboardInterrupt);
        the exception goes on unless another handler of this event takes it."""
        self._on_fail(exception)
        handlers = engine._event_handlers.get(Events.EXCEPTION_RAISED, [])
        if len(handlers) <= 1:  # ours alone: Ignite would swallow it
            raise exception

    @never_raise
    def _on_fail(self, exception: BaseException) -> None:
        self._training = False
        status = "incomplete" if isinstance(exception, KeyboardInterrupt) else "failed"
        self.finish(status, describe(exception))

    # -- the evaluator --------------------------------------------------------------

    @never_raise
    def _on_validation_started(self, engine: Engine) -> None:
        if self._training and self.run.iteration is None and not self.run.in_validation:
            self._validating = True
            self.run.begin_validation()

    @never_raise
    def _on_evaluating(self, engine: Engine, name: str) -> None:
        if self._validating:
            self.switch(name)

    @never_raise
    def _on_validation_batch_completed(self, engine: Engine) -> None:
        if self._validating:
            self.end_batch(True)

    @never_raise
    def _on_validation_completed(self, engine: Engine) -> None:
        if self._validating:
            self._validating = False
            self.run.end_validation()


def _monai_events(engine: Engine) -> Any:
    """MONAI's ``IterationEvents`` when ``engine`` fires them (a MONAI workflow registers
    them), else None (a plain Ignite engine, or no MONAI installed)."""
    try:
        from monai.engines.utils import IterationEvents
    except ImportError:
        return None
    fires = all(event in engine._allowed_events for event in IterationEvents)
    return IterationEvents if fires else None


def _steps(engine: Engine) -> bool:
    """Whether the batch ``engine`` is processing steps the optimizer, as MONAI's
    ``SupervisedTrainer`` decides: every ``accumulation_steps`` batches and at the end
    of an epoch of known length. Always for an engine without accumulation."""
    accumulation = max(int(getattr(engine, "accumulation_steps", 1) or 1), 1)
    if accumulation == 1:
        return True
    length = engine.state.epoch_length
    if length is None:
        return engine.state.iteration % accumulation == 0
    local = (engine.state.iteration - 1) % length + 1  # 1-based within the epoch
    return local % accumulation == 0 or local == length
