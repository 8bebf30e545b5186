"""The state machine behind ``markers.instrument``'s hooks: what each forward, backward
and optimizer step stamps, and where it puts the iteration boundaries (the rules are in
``markers.instrument``'s docstring and docs/contract.md).

Importing this module does not import torch; ``Hooks()`` does.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from markers.forward_hooks import ForwardHooks, warn_other_thread
from markers.iteration import VERBS
from markers.optimizer_filter import OptimizerFilter

if TYPE_CHECKING:
    import torch

    from markers.run import Run

_START, _TRAIN, _VAL = 0, 1, 2  # what the model did last: nothing yet, training, evaluation
# The iteration model's once-a-step verbs, one C call each where markers._speedups is
# built (markers.iteration.VERBS): module globals, the cheapest lookup a hook can make.
_end_whole, _begin_training, _batch_done = VERBS


class Hooks:
    """The state machine behind the hooks (one per ``instrument()`` call).

    ``optimizers``: None hooks every optimizer (global hooks) whose parameters are the
    model's; an empty list hooks none (a framework callback stamps Optimization and the
    iterations itself).

    Every hook runs once or twice per step, so each is one frame with its guard inline
    (never raise, stamp nothing while Dynamo traces it) rather than a wrapper around a
    method: ``bench/instrument_overhead.py`` measures what is left. The hooks are this
    object's bound methods; ``__deepcopy__`` keeps a deep copy of the model (an EMA copy)
    from copying the run with them. Forward hooks on the given modules, not torch's global
    module hooks: those run for every submodule's call too; with or without kwargs, a
    pre-hook costs the same (callgrind, torch 2.13).
    """

    def __init__(
        self,
        run: Run,
        modules: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer] | None,
    ) -> None:
        import torch
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        from markers import wraps

        # Checking whether Dynamo traces a hook costs one frame a call (``wraps.compile_check``);
        # ``torch.compiler.disable`` around every hook cost ~10 µs a step. The call wrappers
        # check it once per call.
        self._dynamo, self._flags = wraps.compile_check()
        self._get_ident = threading.get_ident
        self._thread = threading.get_ident()  # instrument()'s: the training loop's
        self._told_thread = False
        self._grad_enabled = torch.is_grad_enabled
        self._run = run
        # The run's iteration model, driven directly on the hot path: each of Run's
        # one-line primitives would be one more frame a call (~10 a step).
        self._model = run._iter
        self._forward = run.phase("forward")
        self._backward = run.phase("backward")
        self._optimization = run.phase("optimization")
        self._evaluation = run.phase("evaluation")
        self.active = True  # hooks installed
        self._failed = False  # a hook raised: every hook does nothing from then on
        self._last_ns = perf_counter_ns()  # end of the latest step, backward or evaluation
        self._owned: tuple[bool, int] | None = None  # the iteration these hooks opened
        self._state = _START
        self._last_eval_mode = False  # the latest evaluation ran in eval mode
        self._depth = 0  # nesting of instrumented forwards
        self._step_depth = 0  # nesting of optimizer steps
        self._marker: Any = None  # the phase the outermost forward stamps
        self._batch_pending = False  # a training batch began, not yet counted done
        self._after_backward = False  # the next training forward starts a new batch
        self._pending_backward = False  # a backward since the last step
        self._backward_depth = 0  # nesting of backward calls (a reentrant checkpoint)
        self._backward_open = False
        self._grad_forward = False  # a forward under grad since the last backward
        # A no_grad forward in training mode that opened a training iteration, until
        # training goes on (a GAN's generator) or another such forward follows (a test
        # pass without model.eval()): [data loading start, start, end, batch] (ns).
        self._undecided: list[Any] | None = None
        self._probe: torch.nn.Parameter | None = None  # a parameter that has a gradient
        # The first dimension of the last one-tensor training input whose size was read
        # (None: none, or the sizes may have changed since): the same again needs no read.
        self._read_dim: int | None = None
        self._parameters = [p for m in modules for p in m.parameters()]
        self._boundary: torch.optim.Optimizer | None = optimizers[-1] if optimizers else None
        self._optimizers = OptimizerFilter(self._parameters, optimizers)
        self._ours = self._optimizers.known
        self._handles: list[Any] = []
        self._unwrap: list[Callable[[], None]] = []

        self._forward_hooks = ForwardHooks(modules, self._forward_pre, self._forward_post)
        # A module compiled in place (``model.compile()``) compiles its hooks with it: they
        # must run outside the graph. Compiled later, a traced hook notes it (``_traced``,
        # a side effect Dynamo replays at every call) and the next eager hook moves them.
        self._traced = False
        self._forward_hooks.install(
            any(getattr(m, "_compiled_call_impl", None) is not None for m in modules)
        )
        if optimizers is None:
            self._handles.append(register_optimizer_step_pre_hook(self._global_pre))
            self._handles.append(register_optimizer_step_post_hook(self._global_post))
        else:
            for opt in optimizers:
                self._unwrap.append(wraps.wrap_step(opt, self.step_begin, self.step_end))
        self._wraps = wraps
        wraps.listen(self)
        run._open_gpu()  # the model is usually on its device by now: GPU timing from the start

    def _compiled_later(self) -> None:
        """A forward hook was traced by Dynamo (``model.compile()`` or ``torch.compile``
        after ``instrument()``): from the next call on, the hooks run outside the graph
        (Dynamo recompiles once, its guards see other hooks)."""
        self._traced = False
        if not self._forward_hooks.outside_graphs and not self._failed:
            try:
                self._forward_hooks.install(True)
            except Exception as exc:  # never into the training loop
                self._fail(exc)

    def __deepcopy__(self, memo: dict[int, Any]) -> Hooks:
        # A deep copy of an instrumented model (an EMA copy) copies its hooks, our bound
        # methods: they stay these hooks, as plain functions would, and the run is not copied.
        return self

    # -- safety ---------------------------------------------------------------------

    def _fail(self, exc: Exception) -> None:
        # The hooks stay registered (torch may be iterating over them right now) but do
        # nothing from now on; remove() takes them off.
        self._failed = True
        if self._owned is not None and self._run.iteration == self._owned:
            self._run.leave_iteration()
        self._owned = None
        warnings.warn(
            f"markers.instrument: a hook failed ({type(exc).__name__}: {exc}); "
            "the hooks stop measuring, training goes on",
            RuntimeWarning,
            stacklevel=2,
        )

    def remove(self) -> None:
        """Take every hook off; an iteration still open is left unmeasured."""
        if not self.active:
            return
        self.active = False
        self._forward_hooks.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unwrap in self._unwrap:
            unwrap()
        self._unwrap.clear()
        self._wraps.stop_listening(self)
        if self._owned is not None and self._run.iteration == self._owned:
            self._run.leave_iteration()
        self._owned = None

    # -- forward --------------------------------------------------------------------

    def _forward_pre(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self._dynamo() or self._flags._is_compiling_flag:
            self._traced = True  # replayed by Dynamo after each call of the graph
            return
        if self._failed:
            return
        if self._get_ident() != self._thread:
            self._other_thread()
            return
        try:
            self._depth += 1
            if self._depth > 1:
                return
            now_ns = perf_counter_ns()
            run = self._run
            it = self._model.open  # as run.iteration, inline
            opened = None if it is None else (it.validation, it.start_ns)
            if opened is not None and opened != self._owned:
                # A loop driver owns the iteration: stamp the phase only.
                evaluation = opened[0] or run.in_validation or not module.training
                self._marker = self._evaluation if evaluation else self._forward
                if not evaluation:  # its size, where the driver sees no batch (Transformers)
                    run.batch_seen(False, args or kwargs)
                    self._read_dim = None  # the driver may have read another size
            elif (
                module.training
                and not self._model._validation_start_ns  # not in_validation, inline
                and (self._grad_enabled() or self._trains_without_grad())
            ):
                batch = args or kwargs
                if self._grad_enabled():
                    self._undecided = None
                elif self._undecided is not None and self._undecided[2]:
                    # A second no_grad forward in a row, nothing trained in between: a
                    # test pass in training mode, the first one included.
                    self._first_was_evaluation(module)
                    self._begin_evaluation(module, now_ns, batch)
                    self._marker = self._evaluation
                    self._marker.__enter__()
                    return
                elif self._owned is None:
                    start_ns = max(self._last_ns, self._model.boundary_ns)
                    self._undecided = [start_ns, now_ns, 0, batch]
                self._begin_training_forward(now_ns, batch)
                self._marker = self._forward
            else:
                self._begin_evaluation(module, now_ns, args or kwargs)
                self._marker = self._evaluation
            self._marker.__enter__()
        except Exception as exc:  # never into the training loop
            self._fail(exc)

    def _forward_post(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if (
            self._failed
            or self._dynamo()
            or self._flags._is_compiling_flag
            or self._get_ident() != self._thread
        ):
            return
        try:
            self._depth -= 1
            if self._depth:
                return
            marker, self._marker = self._marker, None
            if marker is None:  # hooks installed during this forward
                return
            marker.__exit__(None, None, None)
            if output is None and sys.exc_info()[0] is not None:
                self._forward_raised()
                return
            if self._grad_enabled():
                self._grad_forward = True
            elif self._undecided is not None and not self._undecided[2]:
                self._undecided[2] = perf_counter_ns()
            if marker is self._evaluation and self._owned is not None and self._owned[0]:
                run = self._run
                run.batch_done()
                run.end_iteration()
                self._owned = None
                self._last_ns = perf_counter_ns()
        except Exception as exc:  # never into the training loop
            self._fail(exc)

    def _other_thread(self) -> None:
        """A forward in a thread other than ``instrument()``'s (the loop's): not measured.
        During a backward it is a checkpointed forward recomputed by the autograd engine's
        device thread (part of Backward). Otherwise the module's hooks are shared across
        threads (``nn.DataParallel``'s replicas run in worker threads and copy their
        module's hooks), or the loop runs in another thread: one warning says what to do."""
        if self._backward_open or self._told_thread or self._failed:
            return
        self._told_thread = True
        warn_other_thread()

    def _forward_raised(self) -> None:
        """The outermost forward raised (torch calls the post-hook from its handler): the
        iteration the hooks opened for it is never measured (its batch still counts for
        warmup); what the script does before its next forward is that one's data loading."""
        if self._owned is not None:
            self._leave()
        self._after_backward = False
        self._last_ns = perf_counter_ns()

    def _first_was_evaluation(self, module: torch.nn.Module) -> None:
        """The undecided no_grad forward was the first of a test pass: the training
        iteration it opened is left unmeasured (its batch counts for nothing), and it is
        recorded as the evaluation it was (no GPU time: its kind was known only now_ns)."""
        loading_ns, start_ns, end_ns, batch = self._undecided or (0, 0, 0, None)
        self._undecided = None
        self._batch_pending = False
        self._leave()
        run = self._run
        run.begin_iteration(True, loading_ns)
        run.data_loaded(loading_ns, start_ns)
        run.batch_seen(True, batch)
        run.record_phase("evaluation", start_ns, end_ns)
        run.batch_done()
        run.end_iteration(end_ns)
        self._last_ns = end_ns
        self._state = _VAL
        self._last_eval_mode = not module.training

    def _trains_without_grad(self) -> bool:
        """A forward in training mode under no_grad outside a validation pass: part of
        training once training is under way (a GAN's generator), or right after an
        evaluation in eval mode (the script called model.train() again); an evaluation
        before training otherwise."""
        return self._state == _TRAIN or (self._state == _VAL and self._last_eval_mode)

    def _begin_training_forward(self, now_ns: int, batch: Any) -> None:
        model = self._model
        boundary = model.boundary_ns
        owned = self._owned
        if owned is not None and (
            owned[0]
            or boundary > owned[1]
            or (self._pending_backward and self._gradients_cleared())
        ):
            # An epoch or validation boundary inside it, or its step was skipped
            # (GradScaler): never measured. Its batches still went through the network.
            self._leave()
            self._pending_backward = False
            self._after_backward = False
        first = self._owned is None
        if first or self._after_backward:  # a new batch reached the model
            loading_ns = max(self._last_ns, boundary)
            if self._batch_pending:  # (never when first: letting go of one counts it)
                self._batch_pending = False
                _batch_done(model)
            if first:
                # Whole only at its step: micro-batches left at an epoch's end never
                # stepped. Its data loading goes in with it (one call).
                _begin_training(model, loading_ns, now_ns)
                self._owned = (False, loading_ns)  # what run.iteration now says
            else:
                model.data_loaded(loading_ns, now_ns)
            self._batch_pending = True
            # Every batch counts (a short one inside an accumulation step too). One
            # tensor with the first dimension of the last one read has the same size:
            # nothing to read (most batches). Anything else is read.
            one = batch[0] if type(batch) is tuple and len(batch) == 1 else None
            shape = getattr(one, "shape", None)
            dim = shape[0] if shape else None
            if dim is None or dim != self._read_dim:
                self._run.batch_seen(False, batch)
                self._read_dim = dim
        self._after_backward = False
        self._state = _TRAIN

    def _begin_evaluation(self, module: torch.nn.Module, now_ns: int, batch: Any) -> None:
        run = self._run
        if self._owned is not None:  # a training iteration cut by an evaluation
            self._leave()
        start = max(self._last_ns, run.last_boundary_ns)
        run.begin_iteration(True, start)
        self._owned = (True, start)  # what run.iteration now says
        run.data_loaded(start, now_ns)
        run.batch_seen(True, batch)
        self._state = _VAL
        self._last_eval_mode = not module.training

    def _count_batch(self) -> None:
        """The training batch begun last went through the network (once per batch)."""
        if self._batch_pending:
            self._batch_pending = False
            self._run.batch_done()

    def _leave(self) -> None:
        """Leave the open iteration unmeasured; its batches still count for warmup."""
        self._count_batch()
        if self._run.iteration == self._owned:
            self._run.leave_iteration()
        self._owned = None

    # -- backward -------------------------------------------------------------------
    # Called by ``markers.wraps``'s wrapper of torch.autograd.backward, which does not call
    # them while Dynamo traces it.

    def backward_begin(self) -> None:
        """A call of ``torch.autograd.backward`` begins. Never raises."""
        if self._traced:
            self._compiled_later()
        if self._failed:
            return
        try:
            # Only the outermost call after a forward under grad: a reentrant checkpoint
            # calls backward inside backward, and a backward of another graph is not the
            # model's.
            self._backward_depth += 1
            if self._backward_depth == 1 and self._grad_forward:
                self._grad_forward = False
                self._backward_open = True
                self._backward.__enter__()
        except Exception as exc:  # never into the training loop
            self._fail(exc)

    def backward_end(self) -> None:
        """The call of ``torch.autograd.backward`` returned or raised. Never raises."""
        if self._failed:
            return
        try:
            self._backward_depth = max(self._backward_depth - 1, 0)
            if self._backward_depth or not self._backward_open:
                return
            self._backward.__exit__(None, None, None)
            self._backward_open = False
            self._last_ns = perf_counter_ns()
            self._after_backward = True
            self._pending_backward = True
            # Counted now, not at the step: micro-batches that never step count too.
            if self._batch_pending:
                self._batch_pending = False
                _batch_done(self._model)
            probe = self._probe
            if probe is None or probe.grad is None:
                self._probe = next((p for p in self._parameters if p.grad is not None), None)
        except Exception as exc:  # never into the training loop
            self._fail(exc)

    def _gradients_cleared(self) -> bool:
        """The gradients of the last backward were cleared without a step (zero_grad)."""
        return self._probe is not None and self._probe.grad is None

    # -- optimizer ------------------------------------------------------------------
    # ``step_begin``/``step_end`` are called by the wrapper of each given optimizer's step
    # and ``scaler_step_*`` by the wrapper of GradScaler.step (``markers.wraps``: neither
    # calls them while Dynamo traces it); ``_global_*`` are torch's global step hooks.

    def scaler_step_begin(self, optimizer: Any) -> None:
        """``GradScaler.step(optimizer)`` begins (unscale, inf check, then maybe the
        optimizer's step): all of it is Optimization, and a step it skips still ends the
        iteration. Never raises."""
        if self._is_ours(optimizer):
            self.step_begin(optimizer)

    def scaler_step_end(self, optimizer: Any) -> None:
        """``GradScaler.step(optimizer)`` returned or raised. Never raises."""
        if self._is_ours(optimizer):
            self.step_end(optimizer)

    def step_begin(self, optimizer: Any) -> None:
        """A step of ``optimizer`` (one of ours) begins. Never raises."""
        if self._traced:
            self._compiled_later()
        if self._failed:
            return
        try:
            # A step inside a step (GradScaler's around the optimizer's, a subclass calling
            # super().step(), an optimizer wrapping another) is part of the outer one.
            self._step_depth += 1
            self._undecided = None  # training went on
            if self._step_depth == 1:
                self._optimization.__enter__()
        except Exception as exc:  # never into the training loop
            self._fail(exc)

    def step_end(self, optimizer: Any) -> None:
        """The step of ``optimizer`` returned or raised; the last optimizer's step ends the
        iteration. Never raises."""
        if self._failed:
            return
        try:
            self._step_depth -= 1
            if self._step_depth:
                return
            self._optimization.__exit__(None, None, None)
            self._last_ns = now_ns = perf_counter_ns()
            self._pending_backward = False
            self._after_backward = False
            boundary = self._boundary
            if boundary is not None and optimizer is not boundary:
                return  # a GAN's discriminator step: the iteration goes on
            owned = self._owned
            model = self._model
            it = model.open  # run.iteration == owned, inline
            if (
                owned is not None
                and not owned[0]
                and it is not None
                and not it.validation
                and it.start_ns == owned[1]
            ):
                if self._batch_pending:
                    self._batch_pending = False
                    _batch_done(model)
                _end_whole(model, now_ns)
            self._owned = None
            self._batch_pending = False
        except Exception as exc:  # never into the training loop
            self._fail(exc)

    def _is_ours(self, optimizer: Any) -> bool:
        """True for an optimizer over the instrumented modules' parameters (False once the
        hooks failed). Never raises."""
        if self._failed:
            return False
        try:
            ours = self._ours.get(optimizer)
            return self._optimizers.classify(optimizer) if ours is None else ours
        except Exception as exc:  # never into the training loop
            self._fail(exc)
            return False

    def _global_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not (self._dynamo() or self._flags._is_compiling_flag) and self._is_ours(optimizer):
            self.step_begin(optimizer)

    def _global_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not (self._dynamo() or self._flags._is_compiling_flag) and self._is_ours(optimizer):
            self.step_end(optimizer)
