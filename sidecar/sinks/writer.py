"""Writes every file of a split (docs/contract.md, Files): all texts are built first, then each
file is replaced atomically, so a failure leaves the previous files whole. Two files are shared
with others and written differently (docs/across-processes.md):

* ``summary.log`` may be held open by the user's own logger: it is rewritten in place
  (same inode), our block replaced, their text (also what they append meanwhile) kept.
* ``run.json`` holds every split of the folder, maybe written by several sidecars at once:
  it is read, merged and replaced under the folder's lock (``sinks/locks.py``); its top
  level describes the whole run (the worst status of its splits, the earliest start, the
  latest end).

A split whose ranks are served by several sidecars (one per node, docs/multi-node.md):
each writes its own ranks' tables, its resources (``resources-<node-id>.tsv`` unless it
serves rank 0), its node figures file (``sinks/nodes.py``) and its resume state
(``state/<node-id>.json`` unless it serves rank 0), and its own node entry in run.json,
whose split status is the worst of its nodes'. Only the sidecar serving rank 0 writes
``summary.log`` and ``logs/ranks.tsv``, from every node's figures.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sidecar.model import state
from sidecar.model.efficiency import split_accounts, split_mfu
from sidecar.model.goodput import Account
from sidecar.model.merge import RankFigures, SplitView, figures_of, merged
from sidecar.model.peaks import Mfu
from sidecar.model.split import RUN_STATUS_ORDER, RecordCounts, Split
from sidecar.resources.monitor import ResourceFigures
from sidecar.sinks import (
    goodput_text,
    layout,
    nodes,
    ranks_text,
    resources_text,
    rowtext,
    summary,
    tables,
)
from sidecar.sinks.atomic import WriteBytes, rewrite_in_place, write_atomic
from sidecar.sinks.locks import folder_lock
from sidecar.sinks.nodes import HOSTNAME

Progress = Callable[[str], None]  # told what was just built or written


def records_lines(counts: RecordCounts) -> list[str]:
    """The record lines that close the resources block."""
    lines = [
        f"Records: received {counts.received}, dropped {counts.dropped} (not sent), "
        f"lost {counts.lost} (sent, never received), rejected {counts.rejected}"
    ]
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


def _mfu(split: Split) -> Mfu | None:
    """The split's MFU estimate from the FLOPs per batch its hello gave (None: none)."""
    flops = _number(split.info.get("flops_per_batch"))
    return split_mfu(
        [split.ranks[r] for r in sorted(split.ranks)],
        flops,
        str(split.info.get("flops_dtype") or "bf16"),
        split.gpus[0][1] if split.gpus else None,
    )


def _node_entry(split: Split, accounts: Mapping[int, Account]) -> dict[str, Any]:
    """This sidecar's part of a split's ``run.json`` entry: its ranks' status, times,
    goodput and metadata, and which node it is."""
    info = split.info
    aggs = [a for a in split.ranks.values() if a.sessions]
    mfu = _mfu(split)
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
        "goodput": goodput_text.goodput_entry(accounts),
        "loaders": split.loaders,
        "mfu": None if mfu is None else mfu.to_json(),
        "node_id": nodes.NODE_ID,
        "node_host": HOSTNAME,
        "sidecar_pid": os.getpid(),
        "hosts": _hosts(split),
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
)


def _split_entry(split: Split, previous: Any, accounts: Mapping[int, Account]) -> dict[str, Any]:
    """The ``run.json`` entry of one split: this sidecar's node entry merged with the
    other nodes' entries of ``previous`` (the split's entry as found): ranks, hosts and
    GPUs of every node, the worst status, the earliest start, the latest end (none while
    a node runs), and each node under ``nodes`` (a node that sent no final figures in time
    is written incomplete with the cause)."""
    mine = _node_entry(split, accounts)
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
        entry = next((n for n in others if n.get("node_id") == node_id), None)
        if entry is None:  # it died before its first write of run.json
            entry = {
                "node_id": node_id,
                "node_host": late.host,
                "ranks": list(late.ranks),
                "status": "running",
                "hosts": {late.host: list(late.ranks)},
            }
            others.append(entry)
        if entry.get("status") == "running":
            entry.update(status="incomplete", cause=late.cause)
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
        for key in ("start_unix", "last_unix", "training_s", "wall_s", "sessions")
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
        "gpus": list(gpus.values()),
        "hosts": hosts,
        "nodes": every,
    }


def run_json(split: Split, existing: str, accounts: Mapping[int, Account] | None = None) -> str:
    """The text of ``run.json``: this split's entry merged into what other splits of the
    same folder wrote there before (their entries under ``splits`` are kept), and a top
    level that describes the whole run (docs/contract.md, Files): status and cause of the worst
    split (failed > incomplete > running > completed), the earliest start, the latest end (none
    while a split runs), every GPU of every split, run_id the lowest split's. Call it
    under ``folder_lock``. ``accounts``: the split's goodput accounts per rank (default:
    computed here); the top level's ``goodput`` adds up the splits' means.
    """
    if accounts is None:
        accounts = split_accounts(list(split.ranks.values()), split.straggler_waits)
    try:
        previous = json.loads(existing) if existing else {}
    except ValueError:
        previous = {}
    previous = previous if isinstance(previous, dict) else {}
    found = previous.get("splits")
    splits: dict[str, Any] = found if isinstance(found, dict) else {}
    splits[str(split.split)] = _split_entry(split, splits.get(str(split.split)), accounts)
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
        "goodput": goodput_text.job_entry(entries),
        "versions": info.get("versions", {}),
        "splits": splits,
    }
    return json.dumps(document, indent=2) + "\n"


def _own_figures(split: Split, resources: ResourceFigures) -> list[RankFigures]:
    """The figures of the ranks this sidecar serves, with the samples of the GPU each
    reported (``resources``: the split's, every session's)."""
    out = []
    for rank in sorted(split.ranks):
        info = split.rank_info.get(rank)
        uuid = split.rank_gpus.get(rank)
        out.append(
            figures_of(
                split.ranks[rank],
                info.host if info else HOSTNAME,
                nodes.NODE_ID,
                info.status if info else split.status,
                info.cause if info else split.cause,
                uuid,
                functools.partial(resources.gpu_readings, uuid) if uuid is not None else None,
            )
        )
    return out


def _view(split: Split, own: list[RankFigures], others: list[nodes.NodeFile]) -> SplitView:
    """Every rank of the split: ours, and the other nodes' (a node that sent no final
    figures in time has its running ranks written incomplete with the cause)."""
    theirs = []
    for node in others:
        late = split.late_nodes.get(node.node_id)
        for figures in node.ranks:
            if late is not None and figures.status == "running":
                figures.status, figures.cause = "incomplete", late.cause
            theirs.append(figures)
    return merged(own, theirs, split.world_size)


def _node_text(
    split: Split, own: list[RankFigures], block_lines: list[str], counts: RecordCounts
) -> str:
    """This sidecar's node file of ``split`` (``sinks/nodes.py``): the resources block
    without its title and record lines."""
    return nodes.node_text(
        split.end_unix is not None,
        split.status,
        split.cause,
        split.world_size,
        own,
        block_lines[2 : -len(records_lines(counts)) - 1],
        counts.__dict__,
    )


def write_node_file(split: Split, resources: ResourceFigures, counts: RecordCounts) -> None:
    """Replace only this sidecar's node file of ``split`` (between the writes of its
    files, so that a node that dies leaves figures of its ranks not older than a few
    seconds). Raises OSError when it cannot."""
    block_lines = resources_text.resources_block(
        resources.gpus,
        resources.host,
        resources.gpu_off_reason,
        resources.attribution,
        records_lines(counts),
    )
    write_atomic(
        nodes.node_path(split.split_dir),
        _node_text(split, _own_figures(split, resources), block_lines, counts),
    )


def multi_node(split: Split) -> bool:
    """Whether other sidecars serve ranks of ``split``: this one lacks rank 0 or some of
    the ranks the job said it has."""
    return 0 not in split.ranks or split.world_size > len(split.ranks)


def render(
    split: Split,
    resources: ResourceFigures,
    counts: RecordCounts,
    with_state: bool,
    on_progress: Progress = lambda what: None,
) -> tuple[dict[Path, str], list[str] | None]:
    """The files of ``split`` that are replaced whole, with their text, keyed by path, and
    the lines of our summary block (None before any rank reported, or when another
    sidecar serves rank 0); nothing is written. ``on_progress(file name)`` is called as
    each text is ready.
    """
    files: dict[Path, str] = {}
    ranks = [split.ranks[r] for r in sorted(split.ranks)]
    for agg in ranks:
        for path, table in (
            (split.logs_dir / layout.computational_file(agg.rank), tables.computational_text),
            (split.logs_dir / layout.phases_file(agg.rank), tables.phases_text),
        ):
            files[path] = table(agg)
            on_progress(path.name)
    multi, leader = multi_node(split), 0 in split.ranks
    own = _own_figures(split, resources) if multi or len(ranks) > 1 else []
    others = nodes.read_nodes(split.split_dir) if multi and leader else []
    block = None
    accounts = split_accounts(ranks, split.straggler_waits)
    block_lines = resources_text.resources_block(
        resources.gpus,
        resources.host,
        resources.gpu_off_reason,
        resources.attribution,
        records_lines(counts),
    )
    if ranks and leader:
        view = _view(split, own, others)
        split.standings = tuple(view.stragglers.standings) if view.stragglers else ()
        if others:  # the wait for the slowest rank, compared across every node's ranks
            accounts = split_accounts(
                ranks, split.straggler_waits, {f.rank: f.iterations_view() for f in view.ranks}
            )
        if multi or len(ranks) > 1:
            files[split.logs_dir / layout.RANKS_FILE] = ranks_text.ranks_tsv(view)
        rank_lines = ranks_text.rank_lines(view, split.world_size, split.nodes_waited_s)
        own_host = (
            [
                f"Host {HOSTNAME} (ranks {', '.join(map(str, sorted(split.ranks)))}; "
                f"node {nodes.NODE_ID})"
            ]
            if others
            else []
        )
        block = summary.computational_block(
            ranks,
            [name for _, name in split.gpus],
            split.gaps,
            [
                *block_lines[:2],
                *own_host,
                *block_lines[2 : -len(records_lines(counts)) - 1],
                *ranks_text.host_resource_lines(others),
                "",
                *records_lines(counts),
                *split.export_lines,
            ],
            rank_lines,
            goodput_text.goodput_lines(accounts, _mfu(split)),
        )
    if multi:
        files[nodes.node_path(split.split_dir)] = _node_text(split, own, block_lines, counts)
    if resources.host_samples or resources.gpu_samples:
        frame = resources_text.resources_frame(
            resources.gpu_samples,
            resources.host_samples,
            resources.run_start_ns,
            resources.session_starts_ns,
        )
        name = layout.RESOURCES_FILE if leader else layout.node_resources_file(nodes.NODE_ID)
        files[split.logs_dir / name] = tables.to_tsv(frame, index=False)
        on_progress(name)
    if with_state:
        # the stored rows from the text kept since the last write (rowtext.py)
        path = (
            state.state_path(split.split_dir)
            if leader
            else state.node_state_path(split.split_dir, nodes.NODE_ID)
        )
        files[path] = state.dumps(split.to_state(rowtext.state_rows))
        on_progress(path.name)
    return files, block


def load_modules() -> None:
    """Import what building the texts needs and an idle sidecar does without (pandas).

    Call it before acting as a run's user (a shared daemon): that user may not be allowed
    to read the Python installation the modules come from.
    """
    import pandas  # noqa: F401


def write_split(
    split: Split,
    resources: ResourceFigures,
    counts: RecordCounts,
    with_state: bool = False,
    write_bytes: WriteBytes | None = None,
    on_progress: Progress = lambda what: None,
) -> None:
    """Write all files of ``split``; ``with_state`` adds the resume state (checkpoints).
    ``write_bytes`` puts the bytes into an open file (a seam for a full disk in tests);
    ``on_progress(what)`` is called after each step (the server tells a waiting client).

    Raises OSError from the first file that cannot be written; files already replaced
    stay replaced, the others keep their previous content, none is partial.
    """
    seam = {} if write_bytes is None else {"write_bytes": write_bytes}
    files, block = render(split, resources, counts, with_state, on_progress)
    if 0 in split.ranks:  # files of writes before rank 0 came here, now in the standard ones
        for stale in (
            split.logs_dir / layout.node_resources_file(nodes.NODE_ID),
            state.node_state_path(split.split_dir, nodes.NODE_ID),
        ):
            stale.unlink(missing_ok=True)
    for path, text in files.items():
        write_atomic(path, text, **seam)
        on_progress(path.name)
    if block is not None:
        rewrite_in_place(
            split.split_dir / layout.SUMMARY_FILE,
            lambda existing: summary.replace_block(existing, block),
            **seam,
        )
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
