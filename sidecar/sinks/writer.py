"""Writes every file of a split (docs/contract.md, Files): all texts are built first, then each
file is replaced atomically, so a failure leaves the previous files whole. Two files are shared
with others and written differently (docs/across-processes.md):

* ``summary.log`` may be held open by the user's own logger: it is rewritten in place
  (same inode), our block replaced, their text (also what they append meanwhile) kept.
* ``run.json`` holds every split of the folder, maybe written by several sidecars at once:
  it is read, merged and replaced under the folder's lock (``sinks/locks.py``); its top
  level describes the whole run (the worst status of its splits, the earliest start, the
  latest end).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.model import state
from sidecar.model.split import RUN_STATUS_ORDER, RecordCounts, Split
from sidecar.resources.monitor import ResourceFigures
from sidecar.sinks import layout, resources_text, rowtext, summary, tables
from sidecar.sinks.atomic import WriteBytes, rewrite_in_place, write_atomic
from sidecar.sinks.locks import folder_lock

Progress = Callable[[str], None]  # told what was just built or written

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


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _split_entry(split: Split) -> dict[str, Any]:
    """The ``run.json`` entry of one split: its own status, times and metadata."""
    info = split.info
    aggs = [a for a in split.ranks.values() if a.sessions]
    first = split.ranks.get(0) or next(iter(split.ranks.values()), None)
    start_unix = min((a.run_start_unix for a in aggs), default=info.get("start_unix"))
    return {
        # the run id of the split's first process: the `run` label of the metrics
        # (docs/contract.md, Prometheus metrics)
        "run_id": first.sessions[0].run_id if first and first.sessions else None,
        "status": split.status,
        "cause": split.cause,
        "start": _iso(start_unix),
        "end": _iso(split.end_unix),
        "start_unix": start_unix,
        "end_unix": split.end_unix,
        "sessions": max((len(a.sessions) for a in split.ranks.values()), default=0),
        "ranks": sorted(split.ranks),
        "last_unix": max((a.sessions[-1].last_unix for a in aggs), default=None),
        "training_s": max((a.training_s() for a in split.ranks.values()), default=None),
        "wall_s": max((a.wall_s() for a in split.ranks.values()), default=None),
        "gpus": [{"uuid": uuid, "name": name} for uuid, name in split.gpus],
        **{key: info.get(key) for key in ("host", "user", "job_id", "command", "cwd")},
    }


def run_json(split: Split, existing: str) -> str:
    """The text of ``run.json``: this split's entry merged into what other splits of the
    same folder wrote there before (their entries under ``splits`` are kept), and a top
    level that describes the whole run (docs/contract.md, Files): status and cause of the worst
    split (failed > incomplete > running > completed), the earliest start, the latest end (none
    while a split runs), every GPU of every split, run_id the lowest split's. Call it
    under ``folder_lock``.
    """
    try:
        previous = json.loads(existing) if existing else {}
    except ValueError:
        previous = {}
    previous = previous if isinstance(previous, dict) else {}
    found = previous.get("splits")
    splits: dict[str, Any] = found if isinstance(found, dict) else {}
    splits[str(split.split)] = _split_entry(split)
    entries = [e for _, e in sorted((int(k), e) for k, e in splits.items()
                                    if k.isdigit() and isinstance(e, dict))]
    starts = [t for t in (_number(e.get("start_unix")) for e in entries) if t is not None]
    ends = [t for t in (_number(e.get("end_unix")) for e in entries) if t is not None]
    start_unix = min(starts, default=None)
    end_unix = max(ends) if len(ends) == len(entries) else None  # none while one runs
    worst = max(entries, key=lambda e: RUN_STATUS_ORDER.index(e.get("status"))
                if e.get("status") in RUN_STATUS_ORDER else 0)
    gpus: dict[str, dict[str, Any]] = {}
    for entry in entries:
        for gpu in entry.get("gpus") or []:
            uuid = gpu.get("uuid") if isinstance(gpu, dict) else None
            if isinstance(uuid, str) and uuid not in gpus:
                gpus[uuid] = gpu
    info = split.info
    document = {
        "run_id": entries[0].get("run_id"),
        **{key: info.get(key) for key in ("host", "user", "job_id", "command", "cwd")},
        "start": _iso(start_unix),
        "end": _iso(end_unix),
        # the same instants to the microsecond: the report's wall time (docs/contract.md, Cluster
        # report)
        "start_unix": start_unix,
        "end_unix": end_unix,
        "status": worst.get("status"),
        "cause": worst.get("cause"),
        "gpus": list(gpus.values()),
        "versions": info.get("versions", {}),
        "splits": splits,
    }
    return json.dumps(document, indent=2) + "\n"


def render(split: Split, resources: ResourceFigures, counts: RecordCounts,
           with_state: bool, on_progress: Progress = lambda what: None,
           ) -> tuple[dict[Path, str], list[str] | None]:
    """The files of ``split`` that are replaced whole, with their text, keyed by path, and
    the lines of our summary block (None before any rank reported); nothing is written.
    ``on_progress(file name)`` is called as each text is ready.
    """
    files: dict[Path, str] = {}
    ranks = [split.ranks[r] for r in sorted(split.ranks)]
    for agg in ranks:
        for path, table in (
                (split.logs_dir / layout.computational_file(agg.rank), tables.computational_text),
                (split.logs_dir / layout.phases_file(agg.rank), tables.phases_text)):
            files[path] = table(agg)
            on_progress(path.name)
    block = None
    if ranks:
        block_lines = resources_text.resources_block(
            resources.gpus, resources.host, resources.gpu_off_reason, resources.attribution,
            records_lines(counts))
        block = summary.computational_block(
            ranks, [name for _, name in split.gpus], split.gaps, block_lines)
    if resources.host_samples or resources.gpu_samples:
        frame = resources_text.resources_frame(resources.gpu_samples, resources.host_samples,
                                               resources.run_start_ns, resources.session_starts_ns)
        files[split.logs_dir / layout.RESOURCES_FILE] = tables.to_tsv(frame, index=False)
        on_progress(layout.RESOURCES_FILE)
    if with_state:
        # the stored rows from the text kept since the last write (rowtext.py)
        files[state.state_path(split.split_dir)] = state.dumps(
            split.to_state(rowtext.state_rows))
        on_progress(state.FILE_NAME)
    return files, block


def load_modules() -> None:
    """Import what building the texts needs and an idle sidecar does without (pandas).

    Call it before acting as a run's user (a shared daemon): that user may not be allowed
    to read the Python installation the modules come from.
    """
    import pandas  # noqa: F401


def write_split(split: Split, resources: ResourceFigures, counts: RecordCounts,
                with_state: bool = False, write_bytes: WriteBytes | None = None,
                on_progress: Progress = lambda what: None) -> None:
    """Write all files of ``split``; ``with_state`` adds the resume state (checkpoints).
    ``write_bytes`` puts the bytes into an open file (a seam for a full disk in tests);
    ``on_progress(what)`` is called after each step (the server tells a waiting client).

    Raises OSError from the first file that cannot be written; files already replaced
    stay replaced, the others keep their previous content, none is partial.
    """
    seam = {} if write_bytes is None else {"write_bytes": write_bytes}
    files, block = render(split, resources, counts, with_state, on_progress)
    for path, text in files.items():
        write_atomic(path, text, **seam)
        on_progress(path.name)
    if block is not None:
        rewrite_in_place(split.split_dir / layout.SUMMARY_FILE,
                         lambda existing: summary.replace_block(existing, block), **seam)
        on_progress(layout.SUMMARY_FILE)
    write_run_file(split, write_bytes)
    split.dirty = False
    split.write_error = None


def write_run_file(split: Split, write_bytes: WriteBytes | None = None) -> None:
    """Merge ``split``'s entry into its folder's ``run.json`` (the last file a write
    replaces; alone, where the others do not fit, so that an ended run never says
    ``running``). Raises OSError when it cannot be written."""
    seam = {} if write_bytes is None else {"write_bytes": write_bytes}
    run_path = split.out_dir / layout.RUN_FILE
    with folder_lock(split.out_dir):
        write_atomic(run_path, run_json(split, _read_text(run_path)), **seam)
