"""The node figures files of a split served by several sidecars (docs/multi-node.md).

Each sidecar that serves some ranks of a split, but not every rank the job has, leaves
``training/split-<k>/nodes/<node-id>.json`` at every write of the split, replaced
atomically: its ranks' figures (``sidecar.model.merge.RankFigures``), its status, its
resources block and record counts, and ``final`` once its ranks ended. The sidecar serving
rank 0 reads every other node's file to write the split's one summary; at the end it waits
a bounded time for their final files (``uncovered``).

The node id is ``<host>-<sidecar pid>-<sidecar start, Unix ms>``: unique also when two
sidecars share a host.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.model.merge import RankFigures
from sidecar.sinks import layout

HOSTNAME = socket.gethostname()
NODE_ID = f"{HOSTNAME}-{os.getpid()}-{int(time.time() * 1000)}"


@dataclass(frozen=True)
class NodeFile:
    """Another node's file, read: its id, host, whether its ranks ended, its status and
    cause, when it was written (Unix s), its ranks' figures and its resources lines."""

    node_id: str
    host: str
    final: bool
    status: str
    cause: str | None
    written_unix: float
    ranks: list[RankFigures]
    resources: list[str]


def nodes_dir(split_dir: Path) -> Path:
    """``<split_dir>/nodes``."""
    return split_dir / layout.NODES_DIR


def node_path(split_dir: Path) -> Path:
    """This sidecar's node file of the split."""
    return nodes_dir(split_dir) / f"{NODE_ID}.json"


def node_text(
    final: bool,
    status: str,
    cause: str | None,
    world_size: int,
    ranks: list[RankFigures],
    resources: list[str],
    records: dict[str, Any],
) -> str:
    """The text of this sidecar's node file: ``final`` once its ranks ended, its status
    and cause, the job's world size, its ranks' figures, its resources block's lines
    and its record counts."""
    document = {
        "node_id": NODE_ID,
        "host": HOSTNAME,
        "sidecar_pid": os.getpid(),
        "final": final,
        "status": status,
        "cause": cause,
        "written_unix": time.time(),
        "world_size": world_size,
        "ranks": [figures.to_json() for figures in ranks],
        "resources": resources,
        "records": records,
    }
    return json.dumps(document) + "\n"


def _parse(data: dict[str, Any]) -> NodeFile:
    return NodeFile(
        str(data["node_id"]),
        str(data["host"]),
        bool(data["final"]),
        str(data["status"]),
        data.get("cause"),
        float(data["written_unix"]),
        [RankFigures.from_json(r) for r in data["ranks"]],
        [str(line) for line in data.get("resources") or []],
    )


def read_nodes(split_dir: Path) -> list[NodeFile]:
    """Every other node's file of the split, the newest first; a file that cannot be read
    or parsed (being replaced, or not ours) is left out."""
    found = []
    try:
        paths = sorted(nodes_dir(split_dir).glob("*.json"))
    except OSError:
        return []
    for path in paths:
        if path.stem == NODE_ID:
            continue
        try:
            found.append(_parse(json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda node: -node.written_unix)


def uncovered(
    expected: range, own: set[int], nodes: list[NodeFile], since_unix: float
) -> list[int]:
    """The ``expected`` ranks neither served here (``own``) nor in a final node file
    written since ``since_unix`` (Unix s: an earlier session's files do not count)."""
    final = {
        figures.rank
        for node in nodes
        if node.final and node.written_unix >= since_unix
        for figures in node.ranks
    }
    return [rank for rank in expected if rank not in own and rank not in final]
