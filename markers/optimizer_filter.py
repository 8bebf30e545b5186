"""Which optimizers step the instrumented model: those given to ``instrument()``, or,
with torch's global step hooks, every optimizer over the model's parameters."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any


class OptimizerFilter:
    """The optimizers whose steps are the model's. ``known`` maps each optimizer seen to
    whether it is: the hooks look it up inline (one dict lookup a step, no frame) and call
    ``classify()`` only for one not seen yet."""

    def __init__(self, parameters: list[Any], given: Iterable[Any] | None) -> None:
        self._parameters = parameters
        self._explicit = given is not None  # only the optimizers given count
        self.known: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        for optimizer in given or ():
            self.known[optimizer] = True
        self._stepping: set[int] = set()  # ids of the model's optimizers seen (global hooks)

    def classify(self, optimizer: Any) -> bool:
        """Whether ``optimizer``, not in ``known``, steps the model's parameters (then
        remembered); warns when a second one does. Raises what reading its
        ``param_groups`` raises."""
        if self._explicit:
            return False
        mine = {id(p) for p in self._parameters}
        ours = any(id(p) in mine for group in optimizer.param_groups for p in group["params"])
        self.known[optimizer] = ours
        if ours:
            self._stepping.add(id(optimizer))
            if len(self._stepping) == 2:
                warnings.warn(
                    "markers.instrument: several optimizers step the model; "
                    "each step ends an iteration. Pass them to instrument() "
                    "in the order they step: the last one ends the iteration",
                    RuntimeWarning,
                    stacklevel=5,
                )
        return ours
