"""The text of ``run.json`` (docs/contract.md, Files): every split of a run folder, each
merged from the entries of the sidecars (nodes) that serve its ranks, and a top level that
describes the whole run. Built from a split, its derived figures
(``sidecar.model.derived``) and its record counts; nothing is computed from the rows
here but the throughput, which is the summary's own figure (``sinks/summary.py``).

The sidecar serving rank 0 also states, per split, what its summary states for people:
the throughput of the training and validation loops and the straggler (rank, host,
phase); a sidecar without rank 0 keeps what rank 0's wrote there. The report reads these
(``sidecar.report``), never summary.log's text, where they are present.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

from markers import wire
from sidecar.model.derived import SplitFigures
from sidecar.model.goodput import Account
from sidecar.model.split import NEVER_WROTE, RUN_STATUS_ORDER, RecordCounts, Split
from sidecar.sinks import goodput_text, layout, nodes, summary
from sidecar.sinks.nodes import HOSTNAME


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    return dt.datetime.fromtimestamp(unix, dt.UTC).isoformat(timespec="seconds")


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def read_text(path: Path) -> str:
    """The text of ``path`` ("" when there is none)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def previous_activity(out_dir: Path, split: int) -> float | None:
    """When the split's last process was last heard of (Unix s), as the ``run.json`` of
    ``out_dir`` says; None when unknown (no file, or one we did not write).
    """
    try:
        entry = json.loads(read_text(out_dir / layout.RUN_FILE))["splits"][str(split)]
        return float(entry["last_unix"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _throughput(split: Split) -> dict[str, float | None]:
    """Samples per second of the training and validation loops of the split's lowest
    rank here (rank 0 on the sidecar that writes the summary), rounded as the summary's
    ``Throughput:`` lines print them, so that both files say the same; None unknown."""
    lowest = split.ranks[min(split.ranks)] if split.ranks else None
    out: dict[str, float | None] = {}
    for loop, phase in (("train", wire.TRAINING_LOOP), ("val", wire.VALIDATION_LOOP)):
        rate = summary.throughput(lowest, phase) if lowest is not None else None
        out[loop] = None if rate is None else float(f"{rate:.2f}")
    return out


def _straggler(figures: SplitFigures) -> dict[str, Any] | None:
    """The straggler the rule named over every rank (rank, host, phase), as the summary's
    ``Straggler:`` line; None when it named none or could not compare."""
    compared = figures.stragglers
    if compared is None or compared.verdict.rank is None:
        return None
    verdict = compared.verdict
    return {"rank": verdict.rank, "host": verdict.host, "phase": verdict.phase}


def _node_entry(split: Split, figures: SplitFigures, counts: RecordCounts) -> dict[str, Any]:
    """This sidecar's part of a split's ``run.json`` entry: its ranks' status, times,
    goodput, records dropped and metadata, and which node it is."""
    info = split.info
    aggs = [a for a in split.ranks.values() if a.sessions]
    mfu = figures.mfu
    first = split.ranks.get(0) or next(iter(split.ranks.values()), None)
    # the goodput account's wall, which jobs.tsv and the job report read as end − start
    start_unix, end_unix = split.span_unix()
    last_unix = max((a.sessions[-1].last_unix for a in aggs), default=None)
    return {
        # the run id of the split's first process: the `run` label of the metrics
        # (docs/contract.md, Prometheus metrics)
        "run_id": first.sessions[0].run_id if first and first.sessions else None,
        "status": split.status,
        "cause": split.cause,
        "start": _iso(start_unix),
        "end": _iso(end_unix),
        "start_unix": start_unix,
        "end_unix": end_unix,
        "sessions": max((len(a.sessions) for a in split.ranks.values()), default=0),
        "ranks": sorted(split.ranks),
        "last_unix": last_unix,
        "training_s": max((a.training_s() for a in split.ranks.values()), default=None),
        "wall_s": max((a.wall_s() for a in split.ranks.values()), default=None),
        "gpus": [{"uuid": uuid, "name": name} for uuid, name in split.gpus],
        **{key: info.get(key) for key in ("host", "user", "job_id", "command", "cwd")},
        "goodput": goodput_text.goodput_entry(figures.accounts, figures.mean_account),
        "loaders": split.loaders,
        "mfu": None if mfu is None else mfu.to_json(),
        "node_id": nodes.NODE_ID,
        "node_host": HOSTNAME,
        "sidecar_pid": os.getpid(),
        "hosts": _hosts(split),
        "records_dropped": counts.dropped,
    }


def _hosts(split: Split) -> dict[str, list[int]]:
    """The hosts of the ranks this sidecar serves, with their ranks."""
    hosts: dict[str, list[int]] = {}
    for rank in sorted(split.ranks):
        info = split.rank_info.get(rank)
        hosts.setdefault(info.host if info else HOSTNAME, []).append(rank)
    return hosts


def _worst(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return max(
        entries,
        key=lambda e: (
            RUN_STATUS_ORDER.index(e.get("status")) if e.get("status") in RUN_STATUS_ORDER else 0
        ),
    )


_NODE_KEYS = (
    "node_id",
    "node_host",
    "sidecar_pid",
    "ranks",
    "status",
    "cause",
    "start_unix",
    "end_unix",
    "last_unix",
    "training_s",
    "wall_s",
    "sessions",
    "run_id",
    "hosts",
    "gpus",
    "records_dropped",
)
# What the sidecar serving rank 0 states for the whole split (its summary's figures)
_LEADER_KEYS = ("throughput", "straggler")


def _split_entry(
    split: Split, figures: SplitFigures, counts: RecordCounts, previous: Any
) -> dict[str, Any]:
    """The ``run.json`` entry of one split: this sidecar's node entry merged with the
    other nodes' entries of ``previous`` (the split's entry as found): ranks, hosts and
    GPUs of every node, the worst status, the earliest start, the latest end (none while
    a node runs), the records dropped on every node, and each node under ``nodes`` (a
    node that sent no final figures in time is written incomplete with the cause). The
    throughput and the straggler are rank 0's sidecar's (kept as found by the others)."""
    mine = _node_entry(split, figures, counts)
    if 0 in split.ranks:
        mine.update(throughput=_throughput(split), straggler=_straggler(figures))
    else:
        kept = previous if isinstance(previous, dict) else {}
        mine.update({key: kept.get(key) for key in _LEADER_KEYS})
    found = previous.get("nodes") if isinstance(previous, dict) else None
    others = []
    for node in found or []:
        if not isinstance(node, dict) or node.get("node_id") == nodes.NODE_ID:
            continue
        # the ranks this sidecar claims now are no longer served there (a node restarted
        # or replaced): an entry left with none is gone
        left = [r for r in node.get("ranks") or [] if r not in split.ranks]
        if left:
            kept = {h: [r for r in rs if r in left] for h, rs in (node.get("hosts") or {}).items()}
            others.append({**node, "ranks": left, "hosts": {h: rs for h, rs in kept.items() if rs}})
    for node_id, late in split.late_nodes.items():
        entry = next(
            (
                n
                for n in others
                if n.get("node_id") == node_id
                or (node_id == NEVER_WROTE and set(late.ranks) & set(n.get("ranks") or []))
            ),
            None,
        )
        if entry is None:  # it died before its first write of run.json
            entry = {
                "node_id": node_id or None,
                "node_host": late.host,
                "ranks": list(late.ranks),
                "status": "running",
                "hosts": {late.host: list(late.ranks)} if late.host else {},
            }
            others.append(entry)
        if entry.get("status") == "running":
            # ended as last heard of: its own last activity, else the late node's end
            heard = _number(entry.get("last_unix"))
            entry.update(
                status="incomplete",
                cause=late.cause,
                end_unix=late.end_unix if heard is None else max(heard, late.end_unix),
            )
    every = [{key: mine.get(key) for key in _NODE_KEYS}, *others]
    if not others:
        return {**mine, "nodes": every}
    first = min(every, key=lambda n: min(n.get("ranks") or [1 << 31]))
    worst = _worst(every)
    hosts: dict[str, list[int]] = {}
    for node in every:
        for host, ranks in (node.get("hosts") or {}).items():
            hosts[host] = sorted({*hosts.get(host, []), *ranks})
    ends = [_number(n.get("end_unix")) for n in every]
    numbers = {
        key: [v for v in (_number(n.get(key)) for n in every) if v is not None]
        for key in (
            "start_unix",
            "last_unix",
            "training_s",
            "wall_s",
            "sessions",
            "records_dropped",
        )
    }
    start_unix = min(numbers["start_unix"], default=None)
    end_unix = max(e for e in ends if e is not None) if None not in ends else None
    gpus = {
        g["uuid"]: g
        for n in every
        for g in n.get("gpus") or []
        if isinstance(g, dict) and "uuid" in g
    }
    return {
        **mine,
        "run_id": first.get("run_id"),
        "status": worst.get("status"),
        "cause": worst.get("cause"),
        "start": _iso(start_unix),
        "end": _iso(end_unix),
        "start_unix": start_unix,
        "end_unix": end_unix,
        "sessions": int(max(numbers["sessions"], default=0)),
        "ranks": sorted({r for n in every for r in n.get("ranks") or []}),
        "last_unix": max(numbers["last_unix"], default=None),
        "training_s": max(numbers["training_s"], default=None),
        "wall_s": max(numbers["wall_s"], default=None),
        "records_dropped": int(sum(numbers["records_dropped"])),
        "gpus": list(gpus.values()),
        "hosts": hosts,
        "nodes": every,
    }


def run_json(split: Split, figures: SplitFigures, counts: RecordCounts, existing: str) -> str:
    """The text of ``run.json``: this split's entry merged into what other splits of the
    same folder wrote there before (their entries under ``splits`` are kept), and a top
    level that describes the whole run (docs/contract.md, Files): status and cause of the worst
    split (failed > incomplete > running > completed), the earliest start, the latest end (none
    while a split runs), every GPU of every split, run_id the lowest split's. Call it
    under ``folder_lock``. ``figures``: the split's derived figures (its goodput accounts
    per rank, MFU, straggler); ``counts``: its record counts here. The top level's
    ``goodput`` adds up the splits' means.
    """
    try:
        previous = json.loads(existing) if existing else {}
    except ValueError:
        previous = {}
    previous = previous if isinstance(previous, dict) else {}
    found = previous.get("splits")
    splits: dict[str, Any] = found if isinstance(found, dict) else {}
    splits[str(split.split)] = _split_entry(split, figures, counts, splits.get(str(split.split)))
    entries = [
        e
        for _, e in sorted(
            (int(k), e) for k, e in splits.items() if k.isdigit() and isinstance(e, dict)
        )
    ]
    starts = [t for t in (_number(e.get("start_unix")) for e in entries) if t is not None]
    ends = [t for t in (_number(e.get("end_unix")) for e in entries) if t is not None]
    start_unix = min(starts, default=None)
    end_unix = max(ends) if len(ends) == len(entries) else None  # none while one runs
    worst = _worst(entries)
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
        "goodput": total.to_json() if (total := Account.job_total(entries)) else None,
        "versions": info.get("versions", {}),
        "splits": splits,
    }
    return json.dumps(document, indent=2) + "\n"
