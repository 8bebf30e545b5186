"""``markers.instrument``: the Run's markers put into an unchanged script through hooks.

    run = markers.start_run(out_dir="maps")
    markers.instrument(model, optimizer)          # the loop stays as it is

Which hook stamps what (docs/contract.md, Markers API):

* **Forward**: a forward pre-hook and a forward hook on each given module (only the
  outermost call counts when one instrumented module calls another).
* **Backward**: the whole call of ``loss.backward()`` (``torch.autograd.backward`` is
  wrapped while hooks are on: ``markers.wraps``) after a forward under grad, until the
  engine has run every final callback, so DDP's reducer tail (the wait for the
  all-reduce, the copy back into ``.grad``) is inside. ``torch.autograd.grad`` is not a
  Backward.
* **Optimization**: the whole ``optimizer.step()`` of each optimizer given (its instance's
  ``step`` is wrapped), and the whole ``GradScaler.step(optimizer)`` around it where AMP
  is used (unscale, inf check; a step it skips is an Optimization too and ends its
  iteration). Without an optimizer given, the global step hooks, for optimizers over the
  model's parameters: they leave out torch's profiler scope around the step.
* **Iterations**: a training iteration runs from the end of one optimizer step to the end
  of the next: with accumulation every forward/backward before the step is in it. With
  several optimizers (a GAN), pass them in the order they step: the step of the LAST one
  ends the iteration (a discriminator stepping k times per generator step gives
  iterations of one generator step each). A step skipped without ``GradScaler.step``
  (``optimizer.step()`` never called) is recognised when the gradients are cleared
  (``zero_grad()``, set_to_none by default) before the next forward: that iteration is
  left unmeasured (it has no Optimization, and rows stay aligned). Micro-batches that
  never reach a step (the last ones of an epoch with ``if (i + 1) % k == 0: step()``)
  are cut short at the end of ``run.epoch()`` or of the run: flagged incomplete in
  phases.tsv with the batches they held, no row; without ``run.epoch()`` they join the
  next step, as their gradients do.
* **Training data loading**: from the end of the step (or, within an accumulation step,
  of the previous backward) to the next forward: everything the script does in between
  (fetching, moving to the device, ``zero_grad``) counts.
* **Evaluation / Validation loop**: a forward in eval mode, or under ``no_grad`` outside
  training, is an evaluation: one validation iteration, whose data loading runs from the
  previous evaluation's (or step's) end; the metrics of a batch therefore count in the
  next batch's data loading. A forward in training mode under ``no_grad`` while training
  (a GAN's generator making fakes) is part of the training iteration's Forward; two in a
  row with nothing trained between them are a test pass: evaluations, the first included.

Where the script already uses ``run.train_batches``/``run.val_batches`` (or a framework
callback drives the iterations), the hooks only stamp the phases: the loop driver owns
the iterations and data loading, nothing is counted twice. ``run.epoch()`` and
``run.validation()`` bound the inferred iterations: the first data loading after an
epoch or validation boundary starts at that boundary, and any forward inside
``run.validation()`` is an evaluation. Without them, the first iteration after an
evaluation counts the time since it as data loading; ``warmup_iterations`` leaves out
the first iteration after ``instrument()``.

``torch.compile``: a hook Dynamo traces stamps nothing (it would bake one time into the
graph). ``instrument(torch.compile(m))`` hooks the wrapper, outside the graph. A module
compiled in place (``m.compile()``, before or after ``instrument()``) or compiled by
``torch.compile(m)`` after it gets hooks wrapped in ``torch.compiler.disable`` (at once,
or from the first backward or step after a traced hook noted it), which run eagerly.

A forward that raises (a caught OOM, retried with a smaller batch) ends its stamp: the
forward hook is always called. The iteration opened for it is left unmeasured.

Hooks never raise into the training loop: an error inside one is reported once
(RuntimeWarning) and every hook stops measuring (``remove()`` takes them off).

Importing this module does not import torch; ``instrument()`` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from markers.hooks import Hooks

if TYPE_CHECKING:
    import torch

    from markers.run import NullRun, Run


class Instrumentation:
    """The hooks ``instrument()`` installed; ``remove()`` takes every one off."""

    def __init__(self, hooks: Hooks | None) -> None:
        self._hooks = hooks

    @property
    def active(self) -> bool:
        """True while the hooks are installed."""
        return self._hooks is not None and self._hooks.active

    def remove(self) -> None:
        """Take every hook off; an iteration the hooks left open is never measured.
        Safe to call more than once."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def instrument(
    model: torch.nn.Module | Iterable[torch.nn.Module],
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    run: Run | NullRun | None = None,
) -> Instrumentation:
    """Stamp Forward, Backward, Optimization, Evaluation, data loading and the iteration
    boundaries of ``run`` (default: the run ``start_run`` returned last) through hooks on
    ``model`` (a module or several) and ``optimizer`` (one, several in stepping order,
    None for every optimizer over the model's parameters, or an empty sequence for none:
    when a framework callback stamps Optimization and drives the iterations). Call it once
    per run, with every module and optimizer. See the module docstring for what each hook
    measures. Returns the handle whose ``remove()`` takes the hooks off.

    Raises RuntimeError when no run was given and none was started, TypeError when
    ``model`` holds something that is not a ``torch.nn.Module``.
    """
    import torch

    from markers.run import Run
    from markers.start import current_run

    if run is None:
        run = current_run()
        if run is None:
            raise RuntimeError("markers.instrument: call markers.start_run() first, or pass run=")
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"markers.instrument: {module!r} is not a torch.nn.Module")
    if optimizer is None:
        optimizers = None
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizers = [optimizer]
    else:
        optimizers = list(optimizer)
    if not isinstance(run, Run):  # not monitored: nothing to stamp
        return Instrumentation(None)
    run.prefer_device(modules[0])  # GPU timing follows the model's parameters
    return Instrumentation(Hooks(run, modules, optimizers))
