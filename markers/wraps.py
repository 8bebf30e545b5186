"""The calls ``markers.instrument`` wraps so that its windows hold the whole call:
``torch.autograd.backward`` (what ``Tensor.backward`` calls) and ``GradScaler.step``,
patched while at least one listener is registered, and one optimizer's ``step``.

Hooks inside these calls would miss part of them: a ``grad_fn`` pre-hook fires after the
engine has started, and an engine callback queued there runs before DDP's reducer, which
queues its own (the wait for the all-reduce) later; the optimizer's step hooks leave out
the profiler scope and ``GradScaler``'s unscale and inf check around them. A wrapper
returns only after the engine ran every final callback, so it holds all of it.

Importing this module does not import torch.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol


class Listener(Protocol):
    """What the wrappers tell: a call begins and ends (``optimizer``: the one stepped).
    No method ever raises. The wrappers tell nothing while Dynamo traces them (a time
    read there would be baked into the graph), so listeners need not check."""

    def backward_begin(self) -> None: ...

    def backward_end(self) -> None: ...

    def scaler_step_begin(self, optimizer: Any) -> None: ...

    def scaler_step_end(self, optimizer: Any) -> None: ...


class _Patch:
    """``owner.name`` replaced by a wrapper while listeners are registered; the original
    comes back when the last one leaves (unless someone patched over ours since)."""

    def __init__(
        self,
        owner: Any,
        name: str,
        make: Callable[[Callable[..., Any], list[Listener]], Callable[..., Any]],
    ) -> None:
        self._owner = owner
        self._name = name
        self._make = make
        self.listeners: list[Listener] = []
        self._original: Callable[..., Any] | None = None
        self._wrapper: Callable[..., Any] | None = None

    def add(self, listener: Listener) -> None:
        if not self.listeners:
            self._original = getattr(self._owner, self._name)
            self._wrapper = self._make(self._original, self.listeners)
            setattr(self._owner, self._name, self._wrapper)
        self.listeners.append(listener)

    def discard(self, listener: Listener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)
        if not self.listeners and self._wrapper is not None:
            if getattr(self._owner, self._name) is self._wrapper:
                setattr(self._owner, self._name, self._original)
            # else: patched over since; ours stays underneath and passes straight through
            self._wrapper = self._original = None


# Where torch lacks the two parts of the check below: never compiling by the flag.
_NO_FLAG = types.SimpleNamespace(_is_compiling_flag=False)


def compile_check() -> tuple[Callable[[], bool], Any]:
    """``(dynamo, flags)`` for the check a hook inlines, ``dynamo() or
    flags._is_compiling_flag``: what ``torch.compiler.is_compiling`` answers (True while
    Dynamo traces the caller, or while a compile or an export runs), in one Python frame
    where it takes two (it calls ``torch.jit.is_scripting``). Dynamo folds
    ``is_dynamo_compiling`` to True where it traces the check; in eager code that
    returns False and the flag is what ``is_compiling`` returns. A torch without them
    gets ``is_compiling`` itself. torch is imported by then."""
    import torch.compiler

    dynamo = getattr(torch.compiler, "is_dynamo_compiling", None)
    if dynamo is None or not hasattr(torch.compiler, "_is_compiling_flag"):
        return torch.compiler.is_compiling, _NO_FLAG
    return dynamo, torch.compiler


def _backward_wrapper(
    original: Callable[..., Any], listeners: list[Listener]
) -> Callable[..., Any]:
    dynamo, flags = compile_check()

    def backward(*args: Any, **kwargs: Any) -> Any:
        if not listeners or dynamo() or flags._is_compiling_flag:
            return original(*args, **kwargs)
        for listener in listeners:
            listener.backward_begin()
        try:
            return original(*args, **kwargs)
        finally:
            for listener in listeners:
                listener.backward_end()

    return backward


def _scaler_step_wrapper(
    original: Callable[..., Any], listeners: list[Listener]
) -> Callable[..., Any]:
    dynamo, flags = compile_check()

    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not listeners or dynamo() or flags._is_compiling_flag:
            return original(scaler, optimizer, *args, **kwargs)
        for listener in listeners:
            listener.scaler_step_begin(optimizer)
        try:
            return original(scaler, optimizer, *args, **kwargs)
        finally:
            for listener in listeners:
                listener.scaler_step_end(optimizer)

    return step


_patches: list[_Patch] = []


def listen(listener: Listener) -> None:
    """Wrap ``torch.autograd.backward`` and ``torch.amp.GradScaler.step`` for ``listener``
    (the first listener patches them)."""
    if not _patches:
        import torch
        import torch.amp

        _patches.append(_Patch(torch.autograd, "backward", _backward_wrapper))
        _patches.append(_Patch(torch.amp.GradScaler, "step", _scaler_step_wrapper))
    for patch in _patches:
        patch.add(listener)


def stop_listening(listener: Listener) -> None:
    """Unregister ``listener``; the last one to leave restores the originals."""
    for patch in _patches:
        patch.discard(listener)


def wrap_step(
    optimizer: Any, begin: Callable[[Any], None], end: Callable[[Any], None]
) -> Callable[[], None]:
    """Wrap ``optimizer.step`` (this instance only) between ``begin(optimizer)`` and
    ``end(optimizer)`` (neither called while Dynamo traces the step; neither may raise);
    returns the function that unwraps it.

    The wrapper is a bound method, as LR schedulers expect (they wrap ``step.__func__``),
    and keeps their mark so a scheduler made before does not warn that ``step`` was
    overridden. Unwrapping when something wrapped over ours leaves ours passing through.
    A ``step`` bound before the wrap is timed by the optimizer's own step hooks until the
    wrapper is first called.
    """
    previous = optimizer.step
    had_own = "step" in vars(optimizer)
    active = [True]
    dynamo, flags = compile_check()
    # A ``step`` bound before the wrap (``step = optimizer.step``) never calls the wrapper:
    # torch's own step hooks of the optimizer see it instead. They come off at the
    # wrapper's first call, which shows that the script looks the step up (two calls a
    # step saved); a step they begin ends in the post-hook (torch skips it when the step
    # raises).
    fallback: list[Any] = []
    hooked = [False]

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if fallback:
            for handle in fallback:
                handle.remove()
            fallback.clear()
        if not active[0] or dynamo() or flags._is_compiling_flag:
            return previous(*args, **kwargs)
        begin(self)
        try:
            return previous(*args, **kwargs)
        finally:
            end(self)

    def bound_begin(opt: Any, args: Any, kwargs: Any) -> None:
        if active[0] and not (dynamo() or flags._is_compiling_flag):
            hooked[0] = True
            begin(opt)

    def bound_end(opt: Any, args: Any, kwargs: Any) -> None:
        if hooked[0]:
            hooked[0] = False
            end(opt)

    if hasattr(optimizer, "register_step_pre_hook"):  # torch's Optimizer
        fallback += [
            optimizer.register_step_pre_hook(bound_begin),
            optimizer.register_step_post_hook(bound_end),
        ]
    if hasattr(previous, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    wrapped = types.MethodType(step, optimizer)
    optimizer.step = wrapped

    def unwrap() -> None:
        active[0] = False
        for handle in fallback:
            handle.remove()
        fallback.clear()
        if vars(optimizer).get("step") is wrapped:
            if had_own:
                optimizer.step = previous
            else:
                del optimizer.step

    return unwrap
