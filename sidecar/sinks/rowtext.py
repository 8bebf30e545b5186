"""The stored rows as the writers need them, derived once per row and kept in a
``RowCache`` per aggregator (``sidecar.sinks.rowcache``): each row's line of phases.tsv, its
cells of computational.tsv, its values in the state's columns (JSON text), and the
numbers behind the summary's cells.

At ``num_measurements`` = 10⁵ a checkpoint holds 5·10⁵ stored rows and formatting a
number costs ~1 µs: formatting them all at every checkpoint took seconds, formatting
only the rows added since the last write takes milliseconds. Each number is formatted
once and its text shared by the tables and the state. The text is what the uncached
writers wrote: a float as ``repr`` (what pandas' ``to_csv`` and ``json`` write), a
missing value as an empty cell in the tables and ``null`` in the state, and the rest as
``json.dumps`` writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat
from operator import attrgetter
from weakref import WeakKeyDictionary

import numpy as np

from markers import wire
from sidecar.model.aggregator import RankAggregator
from sidecar.model.series import ROW_FIELDS, Row
from sidecar.model.state import RawJSON
from sidecar.sinks.rowcache import RowCache

# The columns of phases.tsv: label and the Row field behind it (phase and rank: None,
# they come from the series and the aggregator).
PHASES_CELLS: tuple[tuple[str, str | None], ...] = (
    ("phase", None),
    ("epoch", "epoch"),
    ("iteration", "iteration"),
    ("batch", "batch"),
    ("rank", None),
    ("session", "session"),
    ("start (s)", "start_s"),
    ("wall (s)", "wall_s"),
    ("GPU (s)", "gpu_s"),
    ("GPU peak (MB)", "peak_mib"),
    ("batch size", "batch_size"),
    ("batches", "batches"),
    ("flag", "flag"),
)
# A phase's cells in computational.tsv: time, then, for a phase with GPU columns, GPU time
# and GPU peak memory.
SEGMENT_FIELDS = {False: ("wall_s",), True: ("wall_s", "gpu_s", "peak_mib")}
_GPU_PHASES = frozenset(row.phase for row in wire.PHASES if row.gpu)
_FLOATS = frozenset({"wall_s", "gpu_s", "peak_mib", "start_s"})
_TEXTS = frozenset({"flag"})
_ARRAYS = ("start_s", "wall_s", "gpu_s", "peak_mib")  # RowText's float64 arrays
_NONFINITE = frozenset({"nan", "inf", "-inf"})  # float reprs that JSON writes otherwise
NONE_TYPE = type(None)
# The text kept per aggregator; it goes with the aggregator (a split's fresh rank, a
# loaded state's new series lists are derived again: the cache checks each list's identity).
_KEPT: WeakKeyDictionary[RankAggregator, RowCache] = WeakKeyDictionary()


def quoted(text: str) -> str:
    """A cell as the csv module's minimal quoting writes it with a tab separator."""
    if any(c in text for c in '\t"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def table_float(value: float | None) -> str:
    """A float cell of the tables: ``repr`` of the float64, '' when missing or NaN."""
    if value is None:
        return ""
    number = float(value)
    return "" if number != number else float.__repr__(number)


def _json(value: object) -> str:
    return json.dumps(value)


def _float_cells(values: list) -> tuple[list[str], list[str]]:
    """(JSON, table) cells of a float column; None: not measured."""
    kinds = set(map(type, values))
    if kinds == {NONE_TYPE}:
        return ["null"] * len(values), [""] * len(values)
    if kinds == {float}:
        cells = list(map(float.__repr__, values))
        if _NONFINITE.isdisjoint(cells):
            return cells, cells
    elif kinds == {float, NONE_TYPE}:
        table = ["" if v is None else float.__repr__(v) for v in values]
        if _NONFINITE.isdisjoint(table):
            return ["null" if c == "" else c for c in table], table
    return list(map(_json, values)), list(map(table_float, values))


def _int_cells(values: list) -> tuple[list[str], list[str]]:
    """(JSON, table) cells of an integer column; None: unknown (a nullable column)."""
    kinds = set(map(type, values))
    if kinds == {int}:
        cells = list(map(int.__repr__, values))
        return cells, cells
    if kinds == {NONE_TYPE}:
        return ["null"] * len(values), [""] * len(values)
    if kinds == {int, NONE_TYPE}:
        table = ["" if v is None else int.__repr__(v) for v in values]
        return ["null" if c == "" else c for c in table], table
    return (list(map(_json, values)), ["" if v is None else str(int(v)) for v in values])


def _text_cells(values: list) -> tuple[list[str], list[str]]:
    """(JSON, table) cells of a text column: few distinct values, each formatted once."""
    as_json = {v: _json(v) for v in set(values)}
    as_table = {v: "" if v is None else quoted(str(v)) for v in as_json}
    return list(map(as_json.__getitem__, values)), list(map(as_table.__getitem__, values))


@dataclass
class RowText:
    """What the writers need of a run of stored rows (those of one derivation, or all of a
    list merged), in row order."""

    lines: list[str]  # each row's line of phases.tsv (no line end)
    segments: list[str]  # each row's cells of computational.tsv (SEGMENT_FIELDS)
    json: dict[str, str]  # per Row field: its values as JSON, comma-separated
    start_s: np.ndarray  # float64 seconds; the four arrays hold NaN where not measured
    wall_s: np.ndarray
    gpu_s: np.ndarray
    peak_mib: np.ndarray
    known_wall_s: list[float]  # wall_s of the rows of known samples (throughput)
    samples: int  # the samples of those rows, summed


def _derive(rows: list[Row], label_cell: str, rank_cell: str, gpu: bool) -> RowText:
    """The text of ``rows`` of one list of a series; every value read and formatted once."""
    values = {name: list(map(attrgetter(name), rows)) for name in ROW_FIELDS}
    as_json, table = {}, {}
    for name in ROW_FIELDS:
        format_cells = (
            _float_cells if name in _FLOATS else _text_cells if name in _TEXTS else _int_cells
        )
        as_json[name], table[name] = format_cells(values[name])
    constant = {"phase": repeat(label_cell, len(rows)), "rank": repeat(rank_cell, len(rows))}
    lines = list(
        map(
            "\t".join,
            zip(
                *(table[field] if field else constant[label] for label, field in PHASES_CELLS),
                strict=True,
            ),
        )
    )
    segment = SEGMENT_FIELDS[gpu]
    segments = (
        list(map("\t".join, zip(*(table[f] for f in segment), strict=True)))
        if len(segment) > 1
        else table[segment[0]]
    )
    samples = values["samples"]
    return RowText(
        lines,
        segments,
        {name: ",".join(cells) for name, cells in as_json.items()},
        **{name: np.array(values[name], dtype="float64") for name in _ARRAYS},
        known_wall_s=[
            w for w, held in zip(values["wall_s"], samples, strict=True) if held is not None
        ],
        samples=sum(held for held in samples if held is not None),
    )


def _merged(items: list[RowText]) -> RowText:
    """All derivations of one list as one, merged in place (the next write starts from it)."""
    if not items:
        empty = np.array([], dtype="float64")
        return RowText([], [], dict.fromkeys(ROW_FIELDS, ""), empty, empty, empty, empty, [], 0)
    if len(items) > 1:
        items[:] = [
            RowText(
                list(chain.from_iterable(t.lines for t in items)),
                list(chain.from_iterable(t.segments for t in items)),
                {name: ",".join(t.json[name] for t in items) for name in ROW_FIELDS},
                **{name: np.concatenate([getattr(t, name) for t in items]) for name in _ARRAYS},
                known_wall_s=list(chain.from_iterable(t.known_wall_s for t in items)),
                samples=sum(t.samples for t in items),
            )
        ]
    return items[0]


def texts(agg: RankAggregator, phase: int, which: str = "rows") -> RowText:
    """The text of the stored rows (``which="rows"``) or flagged rows (``"flagged"``) of
    ``phase`` of ``agg`` (empty for a phase without a series); rows added since the last
    call are formatted, the others were."""
    series = agg.series.get(phase)
    if series is None:
        return _merged([])
    label = wire.phase_label(phase, agg.custom_names)
    gpu = phase in _GPU_PHASES
    derive = partial(_derive, label_cell=quoted(label), rank_cell=str(agg.rank), gpu=gpu)
    cache = _KEPT.get(agg)
    if cache is None:
        cache = _KEPT[agg] = RowCache()
    return _merged(cache.derived((phase, which, label, gpu), getattr(series, which), derive))


def uncached(agg: RankAggregator, phase: int, rows: list[Row]) -> RowText:
    """The text of ``rows`` of ``phase`` of ``agg`` that no series holds (the whole-run
    sample's, a few thousand at most: formatted at each call, not kept)."""
    label = quoted(wire.phase_label(phase, agg.custom_names))
    return _derive(rows, label, str(agg.rank), phase in _GPU_PHASES)


def state_rows(agg: RankAggregator, phase: int, which: str) -> RawJSON:
    """The state's value of a list of stored rows (``state.rank_state``'s ``rows_state``):
    the JSON of ``state.row_columns``, from the kept text."""
    columns = texts(agg, phase, which).json
    return RawJSON("{" + ",".join(f'"{name}":[{columns[name]}]' for name in ROW_FIELDS) + "}")
