"""What the writers derive from a list of stored rows, kept so each row is derived once.

A checkpoint at ``num_measurements`` = 10⁵ writes 5·10⁵ stored rows, and formatting their
numbers as text costs ~1 µs each: rebuilt at every checkpoint, that alone takes seconds.
The aggregator only appends to a series' ``rows`` and ``flagged``, except ``_align``,
which replaces ``rows`` by a new list. So what was derived from the rows already seen is
kept and only rows added since are derived; a list that is not the one seen before, is
shorter, or whose last seen row is no longer the same object is derived again whole.
This module knows nothing of the text itself (``sidecar.sinks.rowtext`` does), and the
model knows nothing of this cache (``rowtext`` keeps one per aggregator).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from sidecar.model.series import Row

Derive = Callable[[list[Row]], Any]  # rows added since the last call -> one item


@dataclass
class _Derived:
    source: list[Row]  # the list derived from (held: its identity is the check)
    count: int = 0  # rows of ``source`` already derived
    last: Row | None = None  # ``source[count - 1]`` when derived
    items: list[Any] = field(default_factory=list)


class RowCache:
    """Items derived from append-only lists of rows, one item per call that found new rows.

    Not part of the state: a loaded state starts with an empty cache.
    """

    def __init__(self) -> None:
        self._derived: dict[Hashable, _Derived] = {}

    def derived(self, key: Hashable, rows: list[Row], derive: Derive) -> list[Any]:
        """The items derived from ``rows`` under ``key`` (which names everything ``derive``
        depends on besides the rows): ``derive(new rows)`` is appended for the rows added
        since the last call, or the items are derived again from all rows when the list
        was replaced. The caller may merge the returned list's items in place.
        """
        known = self._derived.get(key)
        if (
            known is None
            or known.source is not rows
            or len(rows) < known.count
            or (known.count and rows[known.count - 1] is not known.last)
        ):
            known = self._derived[key] = _Derived(rows)
        if len(rows) > known.count:
            known.items.append(derive(rows[known.count :]))
            known.count, known.last = len(rows), rows[-1]
        return known.items
