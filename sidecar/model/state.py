"""The versioned state file a checkpoint leaves beside a split's files, read on resume;
the same document travels through the training process with ``run.state_dict()``.

Schema history: 1 (first release); 2 adds, per rank, ``saved_unix``, ``downtime_s`` and
``redone_s`` (the wall-time account of resumes) and, per split, ``received`` (records
taken per run id, so a new sidecar knows what its predecessor had) and ``gaps`` (spans
when no sidecar saved the run's records); 3 gives each stored loop row its
``batch_size`` and drops the split's single ``batch_sizes``; within 3, each row also
keeps its ``batches`` and ``flag``, each series its ``flagged`` rows, each rank its
``aligned_custom`` phases and each session its ``worker_phases`` (absent: none); 4 holds
a series' ``rows`` and ``flagged`` as columns (one list per Row field,
``row_columns``) instead of one object per row: a third of the size at 10⁵
stored rows (the field names are no longer repeated per row), which a checkpoint writes
and flushes to disk each time. Within 4, each session also keeps its ``gpu_unfinished``,
``pre_run_s`` and ``sidecar_wait_s``, each rank its ``goodput`` counters per session and
its ``open_spans``: the Epoch or Validation open when the state was taken, as the row of
its part so far (absent: none, not counted), and each row its ``samples`` (absent: batch
size × batches, what throughput counted before), and each session its ``first_step``
and ``steps`` (the optimizer step axis of the exports; absent: 0), and its
``loop_start_ns`` and ``loop_end_ns`` (the framework's own training loop; absent: not
known), and each rank its ``whole_run`` sample (``model/whole_run.py``; absent: none
yet). Older documents are upgraded on reading.

The *lineage* of a state is the run id of its first session: a fresh run starts a
lineage, a resume continues the lineage of the state it loaded.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import asdict
from operator import attrgetter
from pathlib import Path
from typing import Any

from markers.wire import TRAINING_LOOP, VALIDATION_LOOP
from sidecar.model import goodput, whole_run
from sidecar.model.aggregator import RankAggregator
from sidecar.model.series import ROW_FIELDS, PhaseSeries, Row
from sidecar.model.session_clock import Session
from sidecar.model.stats import Welford
from sidecar.model.units import NS_PER_S
from sidecar.model.whole_run import Stride, WholeRun

SCHEMA = 4
# The strides of a whole-run sample (``WholeRun``'s fields, in order) and their bounds.
WHOLE_RUN_KINDS = {
    "training": whole_run.ITERATIONS,
    "validation": whole_run.ITERATIONS,
    "flagged": whole_run.FLAGGED,
}
FILE_NAME = "sidecar-state.json"


# How the state holds one list of stored rows of a rank, given (aggregator, phase, "rows" or
# "flagged"); by default ``row_columns``, the writers pass their kept text.
RowsState = Callable[[RankAggregator, int, str], Any]


class StateError(Exception):
    """A state that cannot be used; the message says why and what to do."""


def row_columns(rows: list[Row]) -> dict[str, list[Any]]:
    """``rows`` as the state holds them: one list of values per Row field (schema 4)."""
    return {name: list(map(attrgetter(name), rows)) for name in ROW_FIELDS}


def rows_from_columns(columns: dict[str, list[Any]]) -> list[Row]:
    """Inverse of ``row_columns``; KeyError for a missing field, ValueError for columns of
    different lengths. Rows saved without their samples hold batch size × batches."""
    if "samples" not in columns:
        held = zip(columns["batch_size"], columns["batches"], strict=True)
        columns = {**columns, "samples": [None if n is None else n * b for n, b in held]}
    return [Row(*values) for values in zip(*(columns[name] for name in ROW_FIELDS), strict=True)]


def _stride_state(stride: Stride) -> dict[str, Any]:
    """A whole-run stride as the state holds it: its counts, and its rows as columns with
    each row's item number and phase key beside them."""
    # an iteration's rows by phase key: the order its phases came in is not kept
    pairs = [
        (number, pair)
        for number, entry in stride.kept.items()
        for pair in sorted(entry, key=lambda pair: pair[0])
    ]
    return {
        "stride": stride.stride,
        "seen": stride.seen,
        "numbers": [number for number, _ in pairs],
        "phases": [phase for _, (phase, _) in pairs],
        "rows": row_columns([row for _, (_, row) in pairs]),
    }


def _stride_from_state(saved: dict[str, Any], capacity: int) -> Stride:
    """Inverse of ``_stride_state``; KeyError or ValueError if broken."""
    stride = Stride(capacity, int(saved["stride"]), int(saved["seen"]))
    rows = rows_from_columns(saved["rows"])
    for number, phase, row in zip(saved["numbers"], saved["phases"], rows, strict=True):
        stride.kept.setdefault(int(number), []).append((int(phase), row))
    return stride


def rank_state(agg: RankAggregator, rows_state: RowsState | None = None) -> dict[str, Any]:
    """Everything needed to resume ``agg``: JSON-serialisable (a ``RawJSON`` aside).

    ``rows_state`` gives each list of stored rows its value in the state (default: its
    columns, ``row_columns``).
    """

    def rows_of(phase: int, which: str) -> Any:
        if rows_state is None:
            return row_columns(getattr(agg.series[phase], which))
        return rows_state(agg, phase, which)

    return {
        "rank": agg.rank,
        "run_start_unix": agg.run_start_unix,
        "training_s": agg.training_s(),
        "saved_unix": agg.sessions[-1].last_unix if agg.sessions else agg.run_start_unix,
        "downtime_s": agg.downtime_s,
        "redone_s": agg.redone_s,
        "gpu_not_measured": agg.gpu_not_measured,
        "stored_iterations": {
            "train": agg.stored_iterations[False],
            "validation": agg.stored_iterations[True],
        },
        "samples": {"train": agg.samples[False], "validation": agg.samples[True]},
        "custom_names": {str(k): v for k, v in agg.custom_names.items()},
        "aligned_custom": sorted(agg.aligned_custom),
        "sessions": [asdict(s) for s in agg.sessions],
        "goodput": [None if c is None else c.to_state() for c in agg.goodput],
        "open_spans": {
            str(phase): row_columns([row]) for phase, row in agg.open_span_parts().items()
        },
        "whole_run": {
            kind: _stride_state(getattr(agg.whole_run, kind)) for kind in WHOLE_RUN_KINDS
        },
        "series": {
            str(phase): {
                "rows": rows_of(phase, "rows"),
                "wall": s.wall.to_list(),
                "gpu": s.gpu.to_list(),
                "flagged": rows_of(phase, "flagged"),
            }
            for phase, s in agg.series.items()
        },
    }


def load_rank(agg: RankAggregator, saved: dict[str, Any], continue_run: str = "") -> None:
    """Restore ``agg`` from ``rank_state`` output (of the current schema); KeyError or
    ValueError if broken.

    ``continue_run``: the run id (hex) of a process that is still running and whose
    session the state's last one is (a new sidecar took over): that session stays open
    and its whole time is measured again from its start.
    """
    agg.run_start_unix = float(saved["run_start_unix"])
    agg.training_before_s = float(saved["training_s"])
    agg.downtime_s = float(saved["downtime_s"])
    agg.redone_s = float(saved["redone_s"])
    agg.gpu_not_measured = int(saved.get("gpu_not_measured", 0))  # added within schema 2
    agg.stored_iterations = {
        False: int(saved["stored_iterations"]["train"]),
        True: int(saved["stored_iterations"]["validation"]),
    }
    samples = saved.get("samples") or {}  # added within schema 3
    agg.samples = {False: samples.get("train"), True: samples.get("validation")}
    agg.restore_custom_names({int(k): str(v) for k, v in saved["custom_names"].items()})
    # Added within schema 3 (absent from older documents: nothing was aligned then).
    agg.aligned_custom = {int(k) for k in saved.get("aligned_custom", [])}
    agg.sessions = [Session(**s) for s in saved["sessions"]]
    # Added within schema 4 (absent: the sessions were not counted, their time is other).
    counted = saved.get("goodput") or []
    agg.goodput = [None if c is None else goodput.Counters.from_state(c) for c in counted]
    if len(agg.goodput) != len(agg.sessions):
        agg.goodput = [None] * len(agg.sessions)
    for s in agg.sessions:  # the state's sessions are over: their time is in training_s
        s.end_ns = s.end_ns if s.end_ns is not None else s.last_ns
    last = agg.sessions[-1] if agg.sessions else None
    going_on = bool(continue_run) and last is not None and last.run_id == continue_run
    if going_on and last is not None:
        ended_ns = last.end_ns if last.end_ns is not None else last.last_ns
        agg.training_before_s -= (ended_ns - last.start_ns) / NS_PER_S
        last.end_ns = None
    for session, counters in zip(agg.sessions, agg.goodput, strict=True):
        if counters is not None and session.end_ns is not None:
            goodput.end_session(counters, session.end_ns)
    # A session appended by begin_session measures from its own start; the sessions
    # above no longer count (their effective time is training_before_s).
    agg.series = {
        int(phase): PhaseSeries(
            rows_from_columns(s["rows"]),
            Welford.from_list(s["wall"]),
            Welford.from_list(s["gpu"]),
            rows_from_columns(s["flagged"]),
        )
        for phase, s in saved["series"].items()
    }
    sampled = saved.get("whole_run") or {}  # added within schema 4
    agg.whole_run = WholeRun(
        *(
            _stride_from_state(sampled[kind], capacity) if kind in sampled else Stride(capacity)
            for kind, capacity in WHOLE_RUN_KINDS.items()
        )
    )
    # A process that goes on (a new sidecar took it over) ends its open spans whole;
    # a resumed one keeps their part up to the checkpoint (added within schema 4).
    agg.continue_parts(
        {}
        if going_on
        else {
            int(phase): rows_from_columns(columns)[0]
            for phase, columns in saved.get("open_spans", {}).items()
        }
    )


STATE_DIR = "state"  # state/<node-id>.json: the state of a node not serving rank 0


def node_state_path(split_dir: Path, node_id: str) -> Path:
    """The state file of the sidecar ``node_id`` when it does not serve rank 0 of a split
    other sidecars serve too (docs/multi-node.md)."""
    return split_dir / STATE_DIR / f"{node_id}.json"


def state_path(split_dir: Path) -> Path:
    """Where the state of the split whose folder is ``split_dir`` lives."""
    return split_dir / FILE_NAME


def document(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` stamped with the current schema (what the file and ``state_dict`` hold)."""
    return {"schema": SCHEMA, **state}


class RawJSON:
    """A value whose JSON text is already made (the writers' cached text of stored rows):
    ``dumps`` puts ``text`` in the document as it is."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def dumps(state: dict[str, Any]) -> str:
    """The text of a state file for ``state`` (stamped with the current schema); a
    ``RawJSON`` value in it is written as its text.

    Compact, without ``indent``: indenting switches ``json`` to its pure-Python encoder,
    ~10× slower on the 10⁵–10⁶ stored rows of a large cap.
    """
    raws: list[str] = []
    nonce = uuid.uuid4().hex  # the placeholders of the RawJSON values: "<nonce><index>"

    def placeholder(value: object) -> str:
        if not isinstance(value, RawJSON):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        raws.append(value.text)
        return f"{nonce}{len(raws) - 1}"

    text = json.dumps(document(state), separators=(",", ":"), default=placeholder)
    if not raws:
        return text
    found = re.compile(f'"{nonce}(\\d+)"')
    if len(found.findall(text)) != len(raws):  # the document's own text held the nonce
        return dumps(state)
    return found.sub(lambda match: raws[int(match[1])], text)


def upgrade(state: Any, where: str = "state") -> dict[str, Any]:
    """``state`` (a decoded document) in the current schema.

    Older schemas are upgraded (schema 1: the fields schema 2 added get their neutral
    values: no downtime, no redone work, nothing received, no gaps). Raises StateError for
    a document that is not an object, has no schema, a newer one (upgrade the sidecar) or
    lacks a field of its schema; ``where`` names the document in the message.
    """
    if not isinstance(state, dict):
        raise StateError(f"{where} is not a JSON object")
    schema = state.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise StateError(
            f"{where} has no valid schema number ({schema!r}); it was not written by a sidecar"
        )
    if schema > SCHEMA:
        raise StateError(
            f"{where} has schema {schema}, newer than this sidecar's {SCHEMA}: "
            "upgrade the sidecar to resume from it"
        )
    for key in ("split", "settings", "gpus", "dropped", "lost", "rejected", "ranks"):
        if key not in state:
            raise StateError(f"{where} (schema {schema}) lacks the field {key!r}")
    state = dict(state)
    if schema == 1:
        state.setdefault("received", {})
        state.setdefault("gaps", [])
        ranks = state["ranks"] if isinstance(state["ranks"], dict) else {}
        state["ranks"] = {
            rank: {"downtime_s": 0.0, "redone_s": 0.0, "saved_unix": _last_unix(saved), **saved}
            for rank, saved in ranks.items()
            if isinstance(saved, dict)
        }
    if schema <= 2:
        _give_rows_batch_sizes(state)
    if schema <= 3:
        _rows_to_columns(state, where)
    state["schema"] = SCHEMA
    return state


def _last_unix(rank_state: dict[str, Any]) -> float:
    """When a schema-1 rank state was saved: the end of its last session."""
    sessions = rank_state.get("sessions") or []
    if not sessions or not isinstance(sessions[-1], dict):
        return float(rank_state.get("run_start_unix", 0.0))
    last = sessions[-1]
    end_ns = last.get("end_ns") if last.get("end_ns") is not None else last.get("last_ns", 0)
    return float(last.get("start_unix", 0.0)) + (end_ns - last.get("start_ns", 0)) / 1e9


def _give_rows_batch_sizes(state: dict[str, Any]) -> None:
    """Schema 2 -> 3: every stored loop row held the split's one batch size (given, else
    the first read)."""
    settings = state["settings"] if isinstance(state["settings"], dict) else {}
    read = state.pop("batch_sizes", None)
    read = read if isinstance(read, dict) else {}
    sizes = {
        str(TRAINING_LOOP): settings.get("train_batch_size") or read.get("train"),
        str(VALIDATION_LOOP): settings.get("val_batch_size") or read.get("validation"),
    }
    for saved in state["ranks"].values() if isinstance(state["ranks"], dict) else ():
        series = saved.get("series") if isinstance(saved, dict) else None
        for phase, size in sizes.items():
            rows = (series or {}).get(phase, {}).get("rows", [])
            for row in rows:
                if isinstance(row, dict):
                    row.setdefault("batch_size", size)


# Row fields that a schema-3 row could lack (added within schema 3): their neutral value.
_ROW_DEFAULTS = {"batch_size": None, "batches": 0, "flag": ""}


def _rows_to_columns(state: dict[str, Any], where: str) -> None:
    """Schema 3 -> 4: each series' ``rows`` and ``flagged`` (absent: none), lists of row
    objects, become columns; lists only (a document already in columns stays as it is).
    Raises StateError for a row that is not an object or lacks a field."""
    for saved in state["ranks"].values() if isinstance(state["ranks"], dict) else ():
        series = saved.get("series") if isinstance(saved, dict) else None
        for phase, entry in series.items() if isinstance(series, dict) else ():
            if not isinstance(entry, dict):
                continue
            entry.setdefault("flagged", [])
            for which in ("rows", "flagged"):
                rows = entry.get(which)
                if not isinstance(rows, list):
                    continue
                if not all(isinstance(row, dict) for row in rows):
                    raise StateError(f"{where}: a stored row of phase {phase} is not an object")
                try:
                    entry[which] = {
                        name: [row[name] if name in row else _ROW_DEFAULTS[name] for row in rows]
                        for name in ROW_FIELDS
                        if name != "samples"  # rows_from_columns tells them
                    }
                except KeyError as exc:
                    raise StateError(
                        f"{where}: a stored row of phase {phase} lacks the field {exc}"
                    ) from None


def lineage(state: dict[str, Any], rank: int) -> str:
    """The run id (hex) that began the lineage of ``rank`` in ``state`` (current schema):
    the run of its first session; '' when the state does not say."""
    saved = state["ranks"].get(str(rank)) if isinstance(state["ranks"], dict) else None
    sessions = saved.get("sessions") if isinstance(saved, dict) else None
    if sessions and isinstance(sessions[0], dict) and isinstance(sessions[0].get("run_id"), str):
        return sessions[0]["run_id"]
    return ""


def load(path: Path) -> dict[str, Any]:
    """Read a state file and return it in the current schema (see ``upgrade``).

    Raises StateError when it is missing, not JSON, or of a schema this version can't read.
    """
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StateError(f"no saved state at {path}: resume needs a checkpoint first") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"state file {path} is unreadable: {exc}") from None
    return upgrade(state, f"state file {path}")
