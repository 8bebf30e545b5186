"""A DataLoader's settings that decide how long a step waits for data (``num_workers``,
``pin_memory``), read from the loader the loop drivers get, for the job's efficiency
advice. Duck-typed: torch is never imported here."""

from __future__ import annotations

from typing import Any

from markers import wire


def loader_control(loader: Any, validation: bool) -> dict[str, Any] | None:
    """The ``loader`` control body for ``loader`` (a ``torch.utils.data.DataLoader`` or any
    object with an int ``num_workers`` and a bool ``pin_memory``); None for another
    iterable."""
    workers = getattr(loader, "num_workers", None)
    pin_memory = getattr(loader, "pin_memory", None)
    if (
        not isinstance(workers, int)
        or isinstance(workers, bool)
        or not isinstance(pin_memory, bool)
    ):
        return None
    return {
        "type": wire.LOADER,
        "kind": "validation" if validation else "train",
        "num_workers": workers,
        "pin_memory": pin_memory,
    }
