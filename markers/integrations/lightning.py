"""``MonitorCallback`` for PyTorch Lightning (``lightning`` and ``pytorch_lightning``).

    trainer = lightning.Trainer(callbacks=[MonitorCallback(warmup_iterations=10)])

Lightning 2.6 calls, per training batch (``accumulate_grad_batches=2``):
``on_train_batch_start`` → ``training_step`` → ``on_before_zero_grad`` (first
micro-batch) → ``on_before_backward`` → ``on_after_backward`` →
``on_before_optimizer_step`` (stepping micro-batch) → ``on_train_batch_end``. So:

* Training data loading: the previous batch's end (or the epoch's or validation's
  start) → ``on_train_batch_start``;
* Forward: ``training_step`` itself (the module's method is wrapped while fitting), loss
  included; Lightning's machinery between ``on_train_batch_start`` and it is in the
  iteration's loop time only;
* Backward: ``on_before_backward`` → ``on_after_backward``;
* Optimization: ``on_before_optimizer_step`` → ``on_train_batch_end`` (the step; there
  is no after-step hook);
* an iteration (Training loop) ends at the end of the batch that stepped (or that
  completes ``accumulate_grad_batches``, or the epoch's last batch): a step skipped by
  AMP still ends it;
* Epoch: ``on_train_epoch_start`` → ``on_train_epoch_end`` (validation inside it);
* Validation: ``on_validation_start`` → ``on_validation_end`` (not the sanity check);
  each validation batch is an iteration, ``on_validation_batch_start`` →
  ``on_validation_batch_end`` its Evaluation (``validation_step`` with its metrics). A
  validation inside an accumulation window (``val_check_interval`` not a multiple of
  ``accumulate_grad_batches``) is its own Validation too: the training iteration is
  suspended, and its loop time leaves the pass out;
* checkpoint saves (``trainer.save_checkpoint``, what ModelCheckpoint calls) are the
  custom phase ``checkpoint``: in no iteration's loop time and no batch's data loading.

With manual optimization, a second optimizer's forward falls into the first one's
Optimization (the hooks cannot tell it apart); use ``markers.instrument`` there.

The run starts in ``setup`` for fitting, with the callback's keyword arguments (those of
``markers.start_run``); not given: ``out_dir`` = the trainer's ``default_root_dir``,
``accumulation_steps`` = ``accumulate_grad_batches``, ``rank`` = ``global_rank``, batch
sizes from the first batches. ``on_save_checkpoint`` puts the monitor's state into the
checkpoint (key ``"trainmon"``) and ``on_load_checkpoint`` continues the split from it, so
``trainer.fit(..., ckpt_path=...)`` continues the measurements; epochs are numbered as
Lightning counts them, and one open at the checkpoint keeps its part up to it (flagged).
The run ends in ``teardown`` (failed after ``on_exception``). Under DDP, start the job with
``sidecar run`` so that all ranks share one sidecar (rank r > 0 writes its own files).

The class derives from ``lightning.pytorch.Callback`` and, when that package is there
too, from ``pytorch_lightning.Callback``, so either namespace's Trainer accepts it.
"""

from __future__ import annotations

import functools
import importlib
from time import perf_counter_ns
from typing import Any

from markers.integrations.base import Monitor, never_raise

STATE_KEY = "trainmon"


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(module).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError(
            "markers.integrations.lightning needs lightning: pip install 'trainmon[lightning]'"
        )
    return tuple(bases)


class MonitorCallback(Monitor, *_callback_bases()):  # type: ignore[misc]
    """Monitors a Lightning fit: takes ``markers.start_run``'s keyword arguments."""

    def __init__(self, **start_run_kwargs: Any) -> None:
        super().__init__(**start_run_kwargs)
        self._stepped = False  # on_before_optimizer_step came in this batch
        self._validating = False
        self._failed: BaseException | None = None

    # -- start, resume, end ---------------------------------------------------------

    @never_raise
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Start the run when fitting begins."""
        if stage == "fit":
            self.start(
                out_dir=trainer.default_root_dir,
                accumulation_steps=trainer.accumulate_grad_batches,
                rank=trainer.global_rank,
            )
            self._cut_out_saves(trainer)
            self._time_training_step(pl_module)

    def _time_training_step(self, pl_module: Any) -> None:
        """Wrap this module's ``training_step`` (an instance attribute, taken off at
        teardown): Forward is the step itself. Lightning's own per-batch work between
        ``on_train_batch_start`` and it (the closure, ``zero_grad`` before the first
        micro-batch, the strategy's wrapper) stays in the iteration, in no phase."""
        step = pl_module.training_step
        if getattr(step, "_trainmon", False):
            return

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            self.switch("forward")
            try:
                return step(*args, **kwargs)
            finally:
                if self._current is self.run.phase("forward"):
                    self.switch(None)  # a manual step's backward or step ends it itself

        training_step._trainmon = True  # type: ignore[attr-defined]
        pl_module.training_step = training_step

    def _cut_out_saves(self, trainer: Any) -> None:
        """Wrap this trainer's ``save_checkpoint`` (what ModelCheckpoint calls, after our
        ``on_validation_end``) so that a save is in no iteration and no batch's data
        loading."""
        save = trainer.save_checkpoint
        if getattr(save, "_trainmon", False):
            return

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            start_ns = perf_counter_ns()
            try:
                return save(*args, **kwargs)
            finally:
                self.cut_out(start_ns)

        save_checkpoint._trainmon = True  # type: ignore[attr-defined]
        trainer.save_checkpoint = save_checkpoint

    @never_raise
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Keep the monitor's state in the checkpoint."""
        checkpoint[STATE_KEY] = self.run.state_dict()

    @never_raise
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Continue the split from the state a checkpoint kept."""
        state = checkpoint.get(STATE_KEY)
        if state:
            self.run.load_state_dict(state)

    @never_raise
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """The fit failed: the files are written, marked failed."""
        self.finish("failed", f"{type(exception).__name__}: {exception}")

    @never_raise
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The fit is over: the sidecar writes the files."""
        if stage == "fit":
            self.finish()
            if getattr(vars(pl_module).get("training_step"), "_trainmon", False):
                del pl_module.training_step

    # -- training -------------------------------------------------------------------

    @never_raise
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """An epoch starts, numbered as Lightning counts (a resume from a checkpoint saved
        in the epoch's last validation goes on from the next epoch)."""
        self.run.begin_epoch(int(trainer.current_epoch))

    @never_raise
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """The epoch (its validation included) ends."""
        self.run.end_epoch()

    @never_raise
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """Data loading ends (Forward is ``training_step`` itself: its wrapper)."""
        self.begin_batch(False, batch)

    @never_raise
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Backward begins."""
        self.switch("backward")

    @never_raise
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """Backward ends."""
        self.switch(None)

    @never_raise
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Optimization begins (it ends with the batch)."""
        self._stepped = True
        self.switch("optimization")

    @never_raise
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The batch ends; the iteration too when the optimizer stepped."""
        stepped, self._stepped = self._stepped, False
        accumulate = max(int(trainer.accumulate_grad_batches), 1)
        self.end_batch(stepped or (batch_idx + 1) % accumulate == 0 or bool(trainer.is_last_batch))

    # -- validation -----------------------------------------------------------------

    @never_raise
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """A validation pass of the fit starts (not the sanity check)."""
        if not trainer.sanity_checking:  # inside an accumulation window too: it is suspended
            self._validating = True
            self.run.begin_validation()

    @never_raise
    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Validation data loading ends, Evaluation begins."""
        if self._validating:
            self.begin_batch(True, batch)
            self.switch("evaluation")

    @never_raise
    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """The validation batch (an iteration) ends."""
        if self._validating:
            self.end_batch(True)

    @never_raise
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """The validation pass ends."""
        if self._validating:
            self._validating = False
            self.run.end_validation()
