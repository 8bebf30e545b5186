"""One split of a run folder as ``sidecar trace`` and ``sidecar compare`` read it: its
run.json entry, the stored rows of every rank (``phases.tsv``, ``phases-rank<r>.tsv``)
and their whole-run samples (``sample.tsv``, ``sample-rank<r>.tsv``: a run past the
cap), its resource samples (``resources.tsv`` and each other node's
``resources-<node>.tsv``) and where each rank's clock starts on the wall clock.

Raises ``read.Damaged`` (one line) for a folder that is not a readable run folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from sidecar.model.split import logs_dir, split_dir
from sidecar.report.read import Damaged
from sidecar.sinks import layout

STATE_FILE = "sidecar-state.json"  # the split's state (its ranks' run starts, Unix s)
NODE_STATES = "state"  # state/<node-id>.json: the same for each other node's ranks


@dataclass(frozen=True)
class SplitRows:
    """The stored rows of one split. ``phases``: every rank's phases.tsv rows (columns as
    written, ``rank`` among them); ``resources``: (table, its origin in Unix s, node id
    or '' for rank 0's sidecar) per resources file; ``rank_start_unix``: each rank's run
    start (the origin of its ``start (s)``), Unix s; ``hosts``: rank -> host."""

    folder: Path
    split: int
    entry: dict[str, Any]
    phases: pd.DataFrame
    resources: list[tuple[pd.DataFrame, float, str]] = field(default_factory=list)
    rank_start_unix: dict[int, float] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)

    @property
    def start_unix(self) -> float:
        """The split's earliest start (Unix s): time 0 of a trace."""
        starts = [*self.rank_start_unix.values(), *(t for _, t, _ in self.resources)]
        return min(starts) if starts else 0.0


def locate(path: Path, split: int | None) -> tuple[Path, int]:
    """The run folder and split that ``path`` names: a run folder (``split`` or its only
    split) or a split folder (``<run>/training/split-<k>``). Raises Damaged."""
    match = re.fullmatch(r"split-(\d+)", path.name)
    if match and path.parent.name == "training" and split is None:
        return path.parent.parent, int(match[1])
    meta = run_meta(path)
    splits = sorted(int(k) for k in meta["splits"])
    if split is None:
        if len(splits) != 1:
            raise Damaged(
                f"{path} holds splits {', '.join(map(str, splits))}: choose one "
                "(--split K, or give FOLDER/training/split-K)"
            )
        split = splits[0]
    if split not in splits:
        raise Damaged(f"{path} has no split {split} (it has {', '.join(map(str, splits))})")
    return path, split


def run_meta(folder: Path) -> dict[str, Any]:
    """The run.json of ``folder``. Raises Damaged."""
    try:
        meta = json.loads((folder / layout.RUN_FILE).read_bytes())
    except FileNotFoundError:
        raise Damaged(f"{folder} is not a run folder (no run.json)") from None
    except OSError as exc:
        raise Damaged(f"{folder}/run.json unreadable: {exc.strerror or exc}") from None
    except ValueError:
        raise Damaged(f"{folder}/run.json is not valid JSON (half-written?)") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("splits"), dict):
        raise Damaged(f"{folder}/run.json lists no split")
    return meta


def _read_tsv(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path, sep="\t", keep_default_na=True, dtype={"flag": str})
    except (OSError, ValueError) as exc:
        raise Damaged(f"{path}: unreadable ({exc})") from None


def _rank_starts(split_dir: Path) -> dict[int, float]:
    """Each rank's run start (Unix s) from the split's state files; ranks absent there
    are left out."""
    starts: dict[int, float] = {}
    for path in [split_dir / STATE_FILE, *sorted((split_dir / NODE_STATES).glob("*.json"))]:
        try:
            ranks = json.loads(path.read_bytes()).get("ranks", {})
        except (OSError, ValueError, AttributeError):
            continue  # absent or half-written: run.json's figures stand in
        for rank, state in ranks.items() if isinstance(ranks, dict) else ():
            start = state.get("run_start_unix") if isinstance(state, dict) else None
            if isinstance(start, (int, float)):
                starts.setdefault(int(rank), float(start))
    return starts


def _node_starts(entry: dict[str, Any]) -> tuple[dict[int, str], dict[str, float]]:
    """(rank -> id of the node serving it, node id -> its start in Unix s), from run.json."""
    by_rank: dict[int, str] = {}
    by_node: dict[str, float] = {}
    for node in entry.get("nodes") or []:
        node_id = str(node.get("node_id", ""))
        start = node.get("start_unix")
        if isinstance(start, (int, float)):
            by_node[node_id] = float(start)
        by_rank.update((int(r), node_id) for r in node.get("ranks", []))
    return by_rank, by_node


def _rank_tables(logs: Path, name: Callable[[int], str]) -> list[pd.DataFrame]:
    """The tables of ``logs`` named ``name(rank)`` (rank 0's first, then by rank), read.
    Raises Damaged."""
    stem = name(0).removesuffix(".tsv")  # rank r's: <stem>-rank<r>.tsv
    pattern = re.compile(re.escape(stem) + r"-rank(\d+)\.tsv")
    others = {
        int(match[1]): path
        for path in logs.glob(f"{stem}-rank*.tsv")
        if (match := pattern.fullmatch(path.name))
    }
    files = [logs / name(0), *(others[rank] for rank in sorted(others))]
    return [_read_tsv(path) for path in files if path.exists()]


def read_split(folder: Path, split: int) -> SplitRows:
    """Every stored row and sample of ``split`` of the run folder ``folder``. A rank's
    clock starts at its run start from the state files, else at its node's start, else at
    the split's (run.json). Raises Damaged."""
    entry = run_meta(folder)["splits"].get(str(split))
    if not isinstance(entry, dict):
        raise Damaged(f"{folder}/run.json: split {split} is not an object")
    logs = logs_dir(folder, split)
    tables = _rank_tables(logs, layout.phases_file)
    if not tables:
        raise Damaged(f"{logs} holds no phases.tsv")
    tables += _rank_tables(logs, layout.sample_file)  # a run past the cap: its sample
    phases = pd.concat(tables, ignore_index=True)
    phases["flag"] = phases["flag"].fillna("")
    split_start = float(entry.get("start_unix") or 0.0)
    rank_nodes, node_starts = _node_starts(entry)
    starts = _rank_starts(split_dir(folder, split))
    for rank in phases["rank"].unique().tolist():
        starts.setdefault(int(rank), node_starts.get(rank_nodes.get(int(rank), ""), split_start))
    hosts = {
        int(rank): str(host) for host, ranks in (entry.get("hosts") or {}).items() for rank in ranks
    }
    resources = []
    if (logs / layout.RESOURCES_FILE).exists():
        origin = starts.get(0, split_start)
        resources.append((_read_tsv(logs / layout.RESOURCES_FILE), origin, rank_nodes.get(0, "")))
    for path in sorted(logs.glob(layout.node_resources_file("*"))):
        node = path.stem.removeprefix("resources-")
        resources.append((_read_tsv(path), node_starts.get(node, split_start), node))
    return SplitRows(folder, split, entry, phases, resources, starts, hosts)
