"""Writes every file of a split (SPEC §3): all texts are built first, then each file is
replaced atomically, so a failure leaves the previous files whole.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from sidecar import state, summary, tables
from sidecar.atomic import write_atomic
from sidecar.monitor import Report
from sidecar.split import Split

SUMMARY_FILE = "summary.log"
RUN_FILE = "run.json"
RESOURCES_FILE = "resources.tsv"


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
        entry = json.loads(_read_text(out_dir / RUN_FILE))["splits"][str(split)]
        return float(entry["last_unix"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_json(split: Split, existing: str) -> str:
    """The text of ``run.json``: this split's run metadata merged into what other splits
    of the same folder wrote there before (their entries under ``splits`` are kept).
    """
    try:
        previous = json.loads(existing) if existing else {}
    except ValueError:
        previous = {}
    splits = previous.get("splits") if isinstance(previous.get("splits"), dict) else {}
    info = split.info
    first = split.ranks.get(0) or next(iter(split.ranks.values()), None)
    splits[str(split.split)] = {
        "status": split.status,
        "cause": split.cause,
        "sessions": max((len(a.sessions) for a in split.ranks.values()), default=0),
        "ranks": sorted(split.ranks),
        "last_unix": max((a.sessions[-1].last_unix for a in split.ranks.values() if a.sessions),
                         default=None),
        "training_s": max((a.training_s() for a in split.ranks.values()), default=None),
        "wall_s": max((a.wall_s() for a in split.ranks.values()), default=None),
    }
    document = {
        # the run id of the split's first process: the `run` label of the metrics (SPEC §7)
        "run_id": first.sessions[0].run_id if first and first.sessions else None,
        "host": info.get("host"),
        "user": info.get("user"),
        "job_id": info.get("job_id"),
        "command": info.get("command"),
        "cwd": info.get("cwd"),
        "start": _iso(info.get("start_unix")),
        "end": _iso(split.end_unix),
        # the same instants to the microsecond: the report's wall time (SPEC §6)
        "start_unix": info.get("start_unix"),
        "end_unix": split.end_unix,
        "status": split.status,
        "cause": split.cause,
        "gpus": [{"uuid": uuid, "name": name} for uuid, name in split.gpus],
        "versions": info.get("versions", {}),
        "splits": splits,
    }
    return json.dumps(document, indent=2) + "\n"


def render(split: Split, resources: Report, with_state: bool) -> dict[Path, str]:
    """Every file of ``split`` and its text, keyed by path (nothing is written)."""
    files: dict[Path, str] = {}
    ranks = [split.ranks[r] for r in sorted(split.ranks)]
    for agg in ranks:
        suffix = "" if agg.rank == 0 else f"-rank{agg.rank}"
        files[split.logs_dir / f"computational{suffix}.tsv"] = tables.to_tsv(
            tables.computational_frame(agg), index=True)
        files[split.logs_dir / f"phases{suffix}.tsv"] = tables.to_tsv(
            tables.phases_frame(agg), index=False)
    if ranks:
        block = summary.computational_block(
            ranks, [name for _, name in split.gpus],
            summary.Throughput(split.batch_size("train"), split.settings.accumulation_steps),
            summary.Throughput(split.batch_size("validation")), split.gaps, resources.lines)
        summary_path = split.split_dir / SUMMARY_FILE
        files[summary_path] = summary.replace_block(_read_text(summary_path), block)
    if resources.frame is not None:
        files[split.logs_dir / RESOURCES_FILE] = tables.to_tsv(resources.frame, index=False)
    run_path = split.out_dir / RUN_FILE
    files[run_path] = run_json(split, _read_text(run_path))
    if with_state:
        files[state.state_path(split.split_dir)] = state.dumps(split.to_state())
    return files


def write_split(split: Split, resources: Report, with_state: bool = False) -> None:
    """Write all files of ``split``; ``with_state`` adds the resume state (checkpoints).

    Raises OSError from the first file that cannot be written; files already replaced
    stay replaced, the others keep their previous content, none is partial.
    """
    for path, text in render(split, resources, with_state).items():
        write_atomic(path, text)
    split.dirty = False
    split.write_error = None
