"""``MonitorCallback`` for the Hugging Face ``Trainer`` (a real ``TrainerCallback``).

    trainer = Trainer(model, args, ..., callbacks=[MonitorCallback(warmup_iterations=10)])

Transformers 5 calls, per optimization step: ``on_step_begin`` → (``on_substep_end``
after each non-final micro-batch) → ``on_pre_optimizer_step`` → ``on_optimizer_step`` →
``on_step_end``; evaluation calls ``on_prediction_step`` per batch, then
``on_evaluate``. The Trainer fetches a step's micro-batches before ``on_step_begin`` and
has no forward or backward events, so:

* an iteration (Training loop) runs from the previous step's end (or the epoch's start,
  the end of an evaluation or of a checkpoint write) to ``on_step_end``; Training data
  loading is its part up to ``on_step_begin`` (fetching all its micro-batches);
* Forward, Backward and Evaluation come from ``markers.instrument`` hooks put on the
  Trainer's model at ``on_train_begin``; each evaluation forward is a validation
  iteration (``instrument``'s rules);
* Optimization: ``on_pre_optimizer_step`` → ``on_optimizer_step`` (a step skipped by
  AMP included; gradient clipping comes before it);
* Validation: from the ``on_step_end`` (or ``on_epoch_end``) that asks for an
  evaluation to ``on_evaluate``: evaluation every ``eval_steps`` inside training is its
  own Validation measurement, outside any training iteration;
* Epoch: ``on_epoch_begin`` → ``on_epoch_end`` (or the end of the evaluation it asks for).

The run starts at ``on_init_end`` (the end of ``Trainer(...)``: a private sidecar's
start-up is not in ``train()``'s time; at ``on_train_begin`` for a callback added later)
with the callback's keyword arguments (those of ``markers.start_run``); not given:
``out_dir`` = ``args.output_dir``, batch sizes read from the first forward of each step
(the hooks see the model's inputs: an epoch's short last step counts its real samples),
``accumulation_steps`` =
``gradient_accumulation_steps``, ``rank`` = ``process_index``. At ``on_save`` the monitor's
state is written into the checkpoint folder (``trainmon-state.json``); a run resumed with
``trainer.train(resume_from_checkpoint=...)`` reads it back from
``args.resume_from_checkpoint`` when that names a folder, else from
``<output_dir>/checkpoint-<global_step>``, and continues the split (an epoch open at the
checkpoint is kept as two flagged parts). The save, from the step's or the evaluation's
end to ``on_save``, is the custom phase ``checkpoint``. The run ends at ``on_train_end``.

``train()`` times itself (``train_runtime``) from just before ``on_train_begin`` to its
speed metrics, which it logs (``on_log``) just before ``on_train_end``. The run's Training
also holds what comes before (the rest of the script after ``Trainer(...)``, ``train()``'s
data loader and model preparation) and after (loading the best model, deleting old
checkpoints): the callback sends that loop's start (``on_train_begin``) and end (the
``on_log`` holding ``train_runtime``) with the finish, and summary.log names both parts.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from time import perf_counter_ns
from typing import Any

from transformers import TrainerCallback

from markers.instrument import Instrumentation, instrument
from markers.integrations.base import Monitor, never_raise

STATE_FILE = "trainmon-state.json"


class MonitorCallback(Monitor, TrainerCallback):
    """Monitors a Trainer's training: takes ``markers.start_run``'s keyword arguments."""

    def __init__(self, **start_run_kwargs: Any) -> None:
        super().__init__(**start_run_kwargs)
        self._hooks = Instrumentation(None)
        self._validating = False
        self._epoch_open = False
        self._epoch_waits_for_evaluation = False
        self._loop_start_ns: int | None = None  # train()'s own clock: on_train_begin
        self._loop_end_ns: int | None = None  # ... to the on_log with its train_runtime

    # -- start, resume, save, end ---------------------------------------------------

    @never_raise
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the run while the Trainer is built: a private sidecar's start-up (about a
        second) is then not inside ``train()``'s time (HF's ``train_runtime``)."""
        self._start(args)

    def _start(self, args: Any) -> None:
        # Batch sizes are read from the model's inputs (instrument()'s hooks): an epoch's
        # short last step holds fewer samples than per_device_train_batch_size.
        self.start(
            out_dir=args.output_dir,
            rank=args.process_index,
            accumulation_steps=args.gradient_accumulation_steps,
        )

    @never_raise
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        """Continue the run from a checkpoint's state, hook the model (and start the run
        if the callback was added after the Trainer was built)."""
        self._loop_start_ns = perf_counter_ns()  # train() read its clock just before
        self._loop_end_ns = None
        self._start(args)
        if state.global_step > 0:
            self._resume(args, state)
        if model is not None:
            # No optimizer: the iterations and Optimization come from the Trainer's events.
            self._hooks = instrument(model, (), self.run)

    def _resume(self, args: Any, state: Any) -> None:
        candidates = [Path(args.output_dir) / f"checkpoint-{state.global_step}"]
        if isinstance(args.resume_from_checkpoint, str):
            candidates.insert(0, Path(args.resume_from_checkpoint))
        for folder in candidates:
            path = folder / STATE_FILE
            if path.is_file():
                self.run.load_state_dict(json.loads(path.read_text()))
                return
        warnings.warn(
            f"markers: resumed at step {state.global_step} but no {STATE_FILE} in "
            f"{', '.join(map(str, candidates))}; the split starts afresh",
            RuntimeWarning,
            stacklevel=2,
        )

    @never_raise
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write the monitor's state into the checkpoint folder just written; the save
        (since the step's or the evaluation's end, the state included) is the
        ``checkpoint`` phase."""
        start_ns = max(self._last_end_ns, self.run.last_boundary_ns)
        saved = self.run.state_dict()
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if saved and args.should_save and folder.is_dir():
            temporary = folder / f".{STATE_FILE}.{os.getpid()}"
            temporary.write_text(json.dumps(saved))
            temporary.replace(folder / STATE_FILE)
        self.cut_out(start_ns)  # no one's data loading

    @never_raise
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training is over: the hooks come off and the sidecar writes the files."""
        self._end_epoch()
        self._hooks.remove()
        start, end = self._loop_start_ns, self._loop_end_ns
        self.finish(loop_ns=(start, end) if start is not None and end is not None else None)

    @never_raise
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        """Logs holding ``train_runtime`` (the last: the speed metrics of train()'s end)
        mark the end of train()'s own clock."""
        if isinstance(logs, dict) and "train_runtime" in logs:
            self._loop_end_ns = perf_counter_ns()

    # -- epochs, steps, evaluation --------------------------------------------------

    @never_raise
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An epoch starts."""
        self._end_epoch()
        self.run.begin_epoch()
        self._epoch_open = True

    @never_raise
    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The epoch ends, after the evaluation it asks for."""
        if control.should_evaluate:
            self._epoch_waits_for_evaluation = True
            self._begin_validation()
        else:
            self._end_epoch()

    def _end_epoch(self) -> None:
        if self._epoch_open:
            self._epoch_open = self._epoch_waits_for_evaluation = False
            self.run.end_epoch()

    @never_raise
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step's micro-batches are fetched: its data loading ends."""
        self.begin_batch(False)

    @never_raise
    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A micro-batch went through the network."""
        self.run.batch_done()

    @never_raise
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Optimization begins."""
        self.switch("optimization")

    @never_raise
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Optimization ends."""
        self.switch(None)

    @never_raise
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The iteration ends; a validation pass starts when the Trainer asks for one."""
        self.end_batch(True)
        if control.should_evaluate:
            self._begin_validation()

    def _begin_validation(self) -> None:
        if not self._validating:
            self._validating = True
            self.run.begin_validation()

    @never_raise
    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The validation pass ends (and the epoch that waited for it)."""
        if self._validating:
            self._validating = False
            self.run.end_validation()
        self.mark()
        if self._epoch_waits_for_evaluation:
            self._end_epoch()
