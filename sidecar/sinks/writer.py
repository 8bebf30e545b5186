"""Writes every file of a split (SPEC §3): all texts are built first, then each file is
replaced atomically, so a failure leaves the previous files whole.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sidecar.model import state
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceFigures
from sidecar.sinks import layout, resources_text, summary, tables
from sidecar.sinks.atomic import write_atomic

WriteFile = Callable[[Path, str], None]  # replaces a file with a text, atomically


@dataclass(frozen=True)
class RecordCounts:
    """Record accounting of one split, for its summary (counts of records)."""

    received: int
    dropped: int  # not sent: the markers' queue was full or no sidecar listened
    lost: int  # sent, never received
    rejected: int
    gpu_not_measured: int | None  # phases the markers could not time on the GPU; None: no GPU


def records_lines(counts: RecordCounts) -> list[str]:
    """The record lines that close the resources block."""
    lines = [f"Records: received {counts.received}, dropped {counts.dropped} (not sent), "
             f"lost {counts.lost} (sent, never received), rejected {counts.rejected}"]
    if counts.gpu_not_measured is not None:  # the event pool ran dry or a device call failed
        lines.append(f"GPU times not measured: {counts.gpu_not_measured} phases")
    return lines


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="seconds")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def previous_activity(out_dir: Path, split: int) -> float | None:
    """When the split's last process was last heard of (Unix s), as the ``run.json`` of
    ``out_dir`` says; None when unknown (no file, or one we did not write).
    """
    try:
        entry = json.loads(_read_text(out_dir / layout.RUN_FILE))["splits"][str(split)]
        return float(entry["last_unix"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# A run folder's status is the worst of its splits' (SPEC §3): later ones win.
RUN_STATUS_ORDER = ("completed", "running", "incomplete", "failed")


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def run_json(split: Split, existing: str) -> str:
    """The text of ``run.json``: this split's run metadata merged into what other splits
    of the same folder wrote there before (their entries under ``splits`` are kept).

    Over all splits listed (SPEC §3): start is the earliest split's, end the latest's
    (none while one runs), status the worst with its cause, run_id the lowest split's.
    """
    try:
        previous = json.loads(existing) if existing else {}
    except ValueError:
        previous = {}
    splits = previous.get("splits") if isinstance(previous.get("splits"), dict) else {}
    info = split.info
    first = split.ranks.get(0) or next(iter(split.ranks.values()), None)
    splits[str(split.split)] = {
        # the run id of the split's first process: the `run` label of the metrics (SPEC §7)
        "run_id": first.sessions[0].run_id if first and first.sessions else None,
        "status": split.status,
        "cause": split.cause,
        "start_unix": info.get("start_unix"),
        "end_unix": split.end_unix,
        "sessions": max((len(a.sessions) for a in split.ranks.values()), default=0),
        "ranks": sorted(split.ranks),
        "last_unix": max((a.sessions[-1].last_unix for a in split.ranks.values() if a.sessions),
                         default=None),
        "training_s": max((a.training_s() for a in split.ranks.values()), default=None),
        "wall_s": max((a.wall_s() for a in split.ranks.values()), default=None),
    }
    entries = [e for _, e in sorted((int(k), e) for k, e in splits.items()
                                    if k.isdigit() and isinstance(e, dict))]
    starts = [t for t in (_number(e.get("start_unix")) for e in entries) if t is not None]
    ends = [t for t in (_number(e.get("end_unix")) for e in entries) if t is not None]
    start_unix = min(starts, default=None)
    end_unix = max(ends) if len(ends) == len(entries) else None  # none while one runs
    worst = max(entries, key=lambda e: RUN_STATUS_ORDER.index(e.get("status"))
                if e.get("status") in RUN_STATUS_ORDER else 0)
    document = {
        "run_id": entries[0].get("run_id"),
        "host": info.get("host"),
        "user": info.get("user"),
        "job_id": info.get("job_id"),
        "command": info.get("command"),
        "cwd": info.get("cwd"),
        "start": _iso(start_unix),
        "end": _iso(end_unix),
        # the same instants to the microsecond: the report's wall time (SPEC §6)
        "start_unix": start_unix,
        "end_unix": end_unix,
        "status": worst.get("status"),
        "cause": worst.get("cause"),
        "gpus": [{"uuid": uuid, "name": name} for uuid, name in split.gpus],
        "versions": info.get("versions", {}),
        "splits": splits,
    }
    return json.dumps(document, indent=2) + "\n"


def render(split: Split, resources: ResourceFigures, counts: RecordCounts,
           with_state: bool) -> dict[Path, str]:
    """Every file of ``split`` and its text, keyed by path (nothing is written)."""
    files: dict[Path, str] = {}
    ranks = [split.ranks[r] for r in sorted(split.ranks)]
    for agg in ranks:
        files[split.logs_dir / layout.computational_file(agg.rank)] = tables.to_tsv(
            tables.computational_frame(agg), index=True)
        files[split.logs_dir / layout.phases_file(agg.rank)] = tables.to_tsv(
            tables.phases_frame(agg), index=False)
    block_lines = resources_text.resources_block(
        resources.gpus, resources.host, resources.gpu_off_reason, resources.attribution,
        records_lines(counts))
    if ranks:
        block = summary.computational_block(
            ranks, [name for _, name in split.gpus],
            summary.Throughput(split.batch_size("train"), split.settings.accumulation_steps),
            summary.Throughput(split.batch_size("validation")), split.gaps, block_lines)
        summary_path = split.split_dir / layout.SUMMARY_FILE
        files[summary_path] = summary.replace_block(_read_text(summary_path), block)
    if resources.host_samples or resources.gpu_samples:
        frame = resources_text.resources_frame(resources.gpu_samples, resources.host_samples,
                                               resources.run_start_ns)
        files[split.logs_dir / layout.RESOURCES_FILE] = tables.to_tsv(frame, index=False)
    run_path = split.out_dir / layout.RUN_FILE
    files[run_path] = run_json(split, _read_text(run_path))
    if with_state:
        files[state.state_path(split.split_dir)] = state.dumps(split.to_state())
    return files


def load_modules() -> None:
    """Import what building the texts needs and an idle sidecar does without (pandas).

    Call it before acting as a run's user (a shared daemon): that user may not be allowed
    to read the Python installation the modules come from.
    """
    import pandas  # noqa: F401


def write_split(split: Split, resources: ResourceFigures, counts: RecordCounts,
                with_state: bool = False, write_file: WriteFile = write_atomic) -> None:
    """Write all files of ``split`` with ``write_file``; ``with_state`` adds the resume
    state (checkpoints).

    Raises OSError from the first file that cannot be written; files already replaced
    stay replaced, the others keep their previous content, none is partial.
    """
    for path, text in render(split, resources, counts, with_state).items():
        write_file(path, text)
    split.dirty = False
    split.write_error = None
