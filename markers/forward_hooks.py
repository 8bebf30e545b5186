"""The forward hooks ``instrument()`` puts on its modules: registered, re-registered to run
outside Dynamo's graphs when a module runs compiled, and taken off.

Importing this module does not import torch; ``install()`` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class ForwardHooks:
    """A forward pre-hook (``pre(module, args, kwargs)``) and an always-called forward hook
    (``post(module, args, output)``) on each of ``modules``."""

    def __init__(
        self,
        modules: list[torch.nn.Module],
        pre: Callable[..., None],
        post: Callable[..., None],
    ) -> None:
        self._modules = modules
        self._pre = pre
        self._post = post
        self._handles: list[Any] = []
        self.outside_graphs = False  # the hooks are wrapped in torch.compiler.disable

    def install(self, outside_graphs: bool) -> None:
        """(Re)register the hooks on every module; with ``outside_graphs``, wrapped in
        ``torch.compiler.disable``: Dynamo then breaks the graph around them and they run
        eagerly (a few µs a call, so only where the module runs compiled)."""
        import torch

        self.remove()
        self.outside_graphs = outside_graphs
        pre, post = self._pre, self._post
        if outside_graphs:
            pre, post = torch.compiler.disable(pre), torch.compiler.disable(post)
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            # always_call: a forward that raises (a caught CUDA OOM, then a smaller batch)
            # still ends its stamp, or every later forward would look nested in it.
            self._handles.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        """Take every hook off (safe to call more than once)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def warn_other_thread() -> None:
    """Say (RuntimeWarning, once per ``instrument()``: the caller keeps count) that an
    instrumented module ran outside the loop's thread, and what to do about it."""
    warnings.warn(
        "markers.instrument: the instrumented module ran in a thread other than "
        "instrument()'s (nn.DataParallel's replicas share its hooks); those forwards "
        "are not measured. Instrument the DataParallel wrapper itself, "
        "instrument(nn.DataParallel(model), optimizer), to time its whole call, or "
        "call instrument() in the training loop's thread",
        RuntimeWarning,
        stacklevel=4,
    )
