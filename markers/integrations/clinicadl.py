"""``MonitorCallback`` for clinicadl's ``Trainer`` (clinicadl 2.0), in place of clinicadl's
own monitor:

    from clinicadl.callbacks import MonitorCallback as StockMonitor
    from markers.integrations.clinicadl import MonitorCallback

    trainer = Trainer(maps, model=..., callbacks=[StockMonitor(enabled=False), MonitorCallback()])

Passed alone, it switches off the stock monitor that clinicadl adds by default (one
warning says so): clinicadl adds its default unless a callback of exactly that class is in
the list, so both would otherwise write their tables.

clinicadl 2.0 calls, per training batch: ``on_batch_start`` → ``on_forward_step_start``
→ ``on_backward_step_start`` → ``on_backward_step_end`` → ``on_optimization_step_start``
/ ``_end`` (stepping batches only) → ``on_batch_end``; per validation batch
``on_batch_start`` → ``on_evaluation_step_start`` → ``on_metrics_computation_start`` /
``_end`` → ``on_batch_end``. So, as clinicadl's users read the 22 columns:

* Training data loading: the previous batch's end (or the epoch's start) →
  ``on_forward_step_start`` (the batch's move to the device included);
* Forward → ``on_backward_step_start``; Backward → ``on_backward_step_end``;
  Optimization between the two optimization events;
* an iteration (Training loop) ends with the batch that stepped: whole accumulation steps.
  The epoch's last batches when they never step (clinicadl carries their gradients into
  the next epoch) are an incomplete iteration: kept in phases.tsv flagged, with the
  batches they held, no row, so every Optimization cell sits on its own step's row;
* Validation: ``on_validation_start`` → ``on_validation_end``; each batch an iteration,
  its data loading up to ``on_evaluation_step_start``, Evaluation up to
  ``on_metrics_computation_start``, Metrics computation up to its end event.

One run per split (``Trainer.train(split)``): the run folder is ``maps.path``, the split
``split.index``, the batch sizes those of the split's loader configs (each batch's own
size from ``len(batch)``), the accumulation that of the optimization config, the GPU
``computational.device`` when ``computational.gpu``; keyword arguments given here (those
of ``markers.start_run``) win. The state travels in clinicadl's own checkpoints
(``TrainingCheckpointCallback`` saves ``state_dict()`` and gives it back to
``load_state_dict`` on ``Trainer.resume``), so ``Trainer.from_maps(maps, ...,
callbacks=[...]).resume(split)`` continues the split. An exception writes the files marked
failed (``on_exception``). A KeyboardInterrupt reaches no clinicadl callback: the split
is written ``incomplete`` when the next split starts on the same callback, or at
interpreter exit.
"""

from __future__ import annotations

import atexit
import sys
import warnings
from typing import Any

from clinicadl.callbacks import Callback
from clinicadl.callbacks import MonitorCallback as StockMonitor

from markers.integrations.base import Monitor, never_raise
from markers.run import NullRun, describe

STATE_KEY = "trainmon"
TRAIN = "train"  # state.called of Trainer.train (clinicadl's TrainerCall.TRAIN)
TRAINING_STAGE = "training"  # state.stage in its training batches (TrainerStage.TRAIN)


class MonitorCallback(Monitor, Callback):
    """Monitors clinicadl's ``Trainer.train``: takes clinicadl's monitor arguments, then
    those of ``markers.start_run``; ``enabled=False`` measures and writes nothing."""

    def __init__(
        self,
        num_measurements: int = 100,
        warmup_iterations: int = 10,
        enabled: bool = True,
        **start_run_kwargs: Any,
    ) -> None:
        super().__init__(
            num_measurements=num_measurements,
            warmup_iterations=warmup_iterations,
            **start_run_kwargs,
        )
        self.enabled = enabled
        self._stepped = False  # on_optimization_step_start came in this batch
        # A resumed split's run, not started until clinicadl's checkpoint has loaded (its
        # first epoch starts): a resume clinicadl refuses leaves the MAPS as it was.
        self._resuming: dict[str, Any] | None = None
        self._saved: dict[str, Any] | None = None  # our state from that checkpoint

    def __repr__(self) -> str:
        """The constructor call that builds this callback again (clinicadl's
        ``callbacks.json`` records it)."""
        kwargs = self.start_run_kwargs
        first = {key: kwargs[key] for key in ("num_measurements", "warmup_iterations")}
        given = {**first, "enabled": self.enabled, **kwargs}  # clinicadl's order first
        arguments = ", ".join(f"{key}={value!r}" for key, value in given.items())
        return f"markers.integrations.clinicadl.MonitorCallback({arguments})"

    # -- start, resume, end ---------------------------------------------------------

    @never_raise
    def on_trainer_init(self, *, callbacks: Any, **kwargs: Any) -> None:
        """Switch off clinicadl's own monitor: the default it added in ours' place always
        (ours with ``enabled=False`` means no monitoring, as the stock's does), one passed
        enabled while ours measures (one Computational Summary per summary.log)."""
        passed = [id(c) for c in getattr(getattr(callbacks, "config", None), "callbacks", [])]
        stock = [c for c in callbacks.callbacks if type(c) is StockMonitor and c.config.enabled]
        added = [c for c in stock if id(c) not in passed]
        for callback in stock if self.enabled else added:
            callback.config.enabled = False
        if self.enabled and stock:
            warnings.warn(
                "markers: clinicadl's own MonitorCallback is switched off, markers' "
                "MonitorCallback replaces it (pass clinicadl.callbacks.MonitorCallback("
                "enabled=False) beside it to say so yourself)",
                UserWarning,
                stacklevel=2,
            )

    @never_raise
    def on_train_start(self, **kwargs: Any) -> None:
        """A split starts: its run starts."""
        if self.enabled:
            self._end_interrupted()
            self._start_split(_split_settings(**kwargs))

    @never_raise
    def on_resume(self, **kwargs: Any) -> None:
        """A split resumes: its run starts with its first epoch, once clinicadl's
        ``TrainingCheckpointCallback`` (called after every other callback) has loaded the
        checkpoint and given ours to ``load_state_dict``; nothing is written before."""
        if self.enabled:
            self._end_interrupted()
            self._resuming, self._saved = _split_settings(**kwargs), None

    def _start_split(self, settings: dict[str, Any]) -> None:
        self._started = False  # one run per split: the base starts once
        self.start(**settings)
        # After start_run's own hook, so that it runs first at exit (a run left open by
        # a KeyboardInterrupt is incomplete, not failed).
        atexit.unregister(self._end_interrupted)
        atexit.register(self._end_interrupted)

    def _end_interrupted(self) -> None:
        """A run still open was cut short without any clinicadl event (a KeyboardInterrupt
        reaches none): written incomplete."""
        if isinstance(self.run, NullRun):
            return
        last = getattr(sys, "last_value", None)
        self.finish(
            "incomplete",
            describe(last) if last is not None else "Trainer.train ended without on_train_end",
        )
        self.run = NullRun()

    @never_raise
    def on_train_end(self, **kwargs: Any) -> None:
        """The split is over: the sidecar writes the files."""
        self._resuming = self._saved = None  # a resume with no epoch left: nothing ran
        self.finish()
        self.run = NullRun()

    @never_raise
    def on_exception(self, *, state: Any, exception: Exception, **kwargs: Any) -> None:
        """The training failed: the files are written, marked failed (a resume that
        failed before its first epoch, clinicadl refusing the checkpoint, writes
        nothing: the MAPS stays as it was)."""
        self._resuming = self._saved = None
        if state.called == TRAIN:
            self.finish("failed", describe(exception))
            self.run = NullRun()

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, for clinicadl's training checkpoint (plain containers)."""
        try:
            return {STATE_KEY: self.run.state_dict()}
        except Exception:  # never into the trainer: a checkpoint without our state
            return {}

    @never_raise
    def load_state_dict(self, state_dict: Any) -> None:
        """Continue the split from the state a checkpoint kept."""
        state = state_dict.get(STATE_KEY) if state_dict else None
        if state and self._resuming is not None:
            self._saved = state  # loaded when the run starts, at the first epoch
        elif state:
            self.run.load_state_dict(state)

    # -- training -------------------------------------------------------------------

    @never_raise
    def on_epoch_start(self, *, state: Any, **kwargs: Any) -> None:
        """An epoch starts (clinicadl counts from 1); a resumed split's run starts at its
        first, from the checkpoint's state."""
        if self._resuming is not None:
            settings, saved = self._resuming, self._saved
            self._resuming = self._saved = None
            self._start_split(settings)
            if saved:
                self.run.load_state_dict(saved)
        self.run.begin_epoch(int(state.current_epoch) - 1)

    @never_raise
    def on_epoch_end(self, **kwargs: Any) -> None:
        """The epoch (its validation included) ends."""
        self.run.end_epoch()

    @never_raise
    def on_forward_step_start(self, *, batch: Any, **kwargs: Any) -> None:
        """Data loading ends, Forward begins."""
        self.begin_batch(False, batch)
        self.switch("forward")

    @never_raise
    def on_backward_step_start(self, **kwargs: Any) -> None:
        """Backward begins."""
        self.switch("backward")

    @never_raise
    def on_backward_step_end(self, **kwargs: Any) -> None:
        """Backward ends."""
        self.switch(None)

    @never_raise
    def on_optimization_step_start(self, **kwargs: Any) -> None:
        """Optimization begins."""
        self._stepped = True
        self.switch("optimization")

    @never_raise
    def on_optimization_step_end(self, **kwargs: Any) -> None:
        """Optimization ends."""
        self.switch(None)

    @never_raise
    def on_batch_end(self, *, state: Any, **kwargs: Any) -> None:
        """The batch ends; a validation batch's iteration too, a training batch's when the
        optimizer stepped or the epoch has no batch left."""
        if state.called != TRAIN:
            return
        if state.stage == TRAINING_STAGE:
            stepped, self._stepped = self._stepped, False
            self.end_batch(stepped)
            if not stepped and state.current_train_batch >= state.num_train_batches:
                # clinicadl carries this batch's gradients into the next epoch: no whole
                # step, so no row (it would take a later step's Optimization cell).
                self.run.leave_iteration()
        else:
            self.end_batch(True)

    # -- validation -----------------------------------------------------------------

    @never_raise
    def on_validation_start(self, **kwargs: Any) -> None:
        """The validation pass of an epoch starts."""
        self.run.begin_validation()

    @never_raise
    def on_evaluation_step_start(self, *, state: Any, batch: Any, **kwargs: Any) -> None:
        """Validation data loading ends, Evaluation begins."""
        if state.called == TRAIN:
            self.begin_batch(True, batch)
            self.switch("evaluation")

    @never_raise
    def on_metrics_computation_start(self, *, state: Any, **kwargs: Any) -> None:
        """Metrics computation begins."""
        if state.called == TRAIN:
            self.switch("metrics")

    @never_raise
    def on_metrics_computation_end(self, *, state: Any, **kwargs: Any) -> None:
        """Metrics computation ends."""
        if state.called == TRAIN:
            self.switch(None)

    @never_raise
    def on_validation_end(self, **kwargs: Any) -> None:
        """The validation pass ends."""
        self.run.end_validation()


def _split_settings(
    *, maps: Any, split: Any, optimization: Any, computational: Any, **kwargs: Any
) -> dict[str, Any]:
    """``start_run``'s arguments read from the Trainer's ``on_train_start``/``on_resume``
    arguments: the MAPS folder, the split, its batch sizes, the accumulation, the GPU."""
    return {
        "out_dir": maps.path,
        "split": split.index,
        "train_batch_size": split.config.train_loader_config.batch_size,
        "val_batch_size": split.config.val_loader_config.batch_size,
        "accumulation_steps": optimization.accumulation_steps,
        "device": computational.device if computational.gpu else None,
    }
