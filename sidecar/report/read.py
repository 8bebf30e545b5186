"""Finding run folders and reading the files the report needs, with the checks that tell a
damaged or half-written folder from a good one (docs/contract.md, Faults and bad input and Cluster
report).

Only bytes are read here; parsing the tables is left to ``sidecar.report.figures``, which
parses the files of all folders at once.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.model import split as split_paths
from sidecar.resources import fields
from sidecar.sinks import layout
from sidecar.sinks.summary import TITLE_LINE
from sidecar.sinks.tables import COLUMNS

# What a computational.tsv header starts with; custom phase columns may follow. Earlier
# versions wrote an index column first (layout.INDEX_LABEL): still read, without it.
COMPUTATIONAL_HEADER = "\t".join(label for label, _, _ in COLUMNS).encode()
OLD_INDEX = layout.INDEX_LABEL.encode() + b"\t"
_FIRST_FIELD = re.compile(rb"^[^\t\n]*\t", re.M)
REQUIRED_KEYS = ("status", "start", "splits")


class Damaged(Exception):
    """A run folder the report skips; the message says why."""


@dataclass(frozen=True)
class SplitFiles:
    """The raw files of one split: tables without their header line."""

    split: int
    training_s: float  # the split's Training time: its weight among the run's splits
    computational: bytes  # body of computational.tsv (rank 0)
    computational_columns: int  # fields per line, custom phases included
    resources: bytes  # body of resources.tsv; b"" when the split has no samples
    resources_columns: tuple[str, ...]  # its header: a file of an older or newer version
    # may lack optional columns or hold columns appended since; readers go by name
    summary: str  # summary.log; '' where run.json states its figures (not read)
    ranks: str = ""  # logs/ranks.tsv (several ranks compared; docs/multi-node.md), or ""
    # (body, header) of each other node's resources-<node-id>.tsv (docs/multi-node.md):
    # its host's samples, which the job's energy and host figures add up with rank 0's
    node_resources: tuple[tuple[bytes, tuple[str, ...]], ...] = ()
    # the split's entry in run.json: the figures its sidecars state there (throughput,
    # records dropped, straggler); a folder written before them lacks those keys
    entry: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunFolder:
    """A readable run folder: its ``run.json`` and the files of each split it lists."""

    path: Path
    meta: dict[str, Any]
    splits: list[SplitFiles]


def find_run_folders(paths: Iterable[Path]) -> Iterator[Path]:
    """Every folder holding a ``run.json`` under ``paths`` (a path may itself be one), in
    sorted order. A run folder is not searched further: its own subfolders are its splits.
    """
    for root in paths:
        for folder, subfolders, files in os.walk(root):
            if layout.RUN_FILE in files:
                subfolders.clear()
                yield Path(folder)
            else:
                subfolders.sort()


def _has_columns(required: Iterable[str]) -> Callable[[bytes], bool]:
    wanted = {name.encode() for name in required}
    return lambda first: wanted <= set(first.split(b"\t"))


def _body(path: Path, ours: Callable[[bytes], bool]) -> tuple[bytes, bytes]:
    """The lines after the header of the TSV at ``path``, and its header line.

    Raises Damaged when ``ours(header)`` is false or a line has another number of fields
    than the header (a truncated or foreign file); FileNotFoundError passes through.
    """
    data = path.read_bytes()
    end = data.find(b"\n")
    first = data[:end] if end >= 0 else data
    if not ours(first):
        raise Damaged(f"{path.name}: not the expected header")
    body = data[end + 1 :]
    if body and not body.endswith(b"\n"):
        raise Damaged(f"{path.name}: last line cut short")
    width = first.count(b"\t") + 1
    # every line holds width − 1 tabs: counted in C, no line is split here
    if body.count(b"\t") != body.count(b"\n") * (width - 1):
        raise Damaged(f"{path.name}: a line has the wrong number of fields")
    return body, first


def _resources_body(path: Path) -> tuple[bytes, tuple[str, ...]]:
    """The body and column names of a resources table: its required columns in any
    order, others (appended by a later version) kept. Raises Damaged, FileNotFoundError."""
    body, header = _body(path, _has_columns(fields.required_columns()))
    return body, tuple(header.decode().split("\t"))


def _computational(path: Path) -> tuple[bytes, bytes]:
    """The body and header of a computational.tsv, in today's columns: the index column
    of an earlier version's file is dropped from every line. Raises Damaged,
    FileNotFoundError."""
    body, header = _body(
        path,
        lambda first: first.removeprefix(OLD_INDEX).startswith(COMPUTATIONAL_HEADER),
    )
    if header.startswith(OLD_INDEX):
        return _FIRST_FIELD.sub(b"", body), header.removeprefix(OLD_INDEX)
    return body, header


def states_figures(entry: dict[str, Any]) -> bool:
    """Whether a split's run.json entry states every figure the report takes from a
    split (a folder written before it did: they are read from its summary.log)."""
    return (
        isinstance(entry.get("throughput"), dict)
        and isinstance(entry.get("records_dropped"), int)
        and "straggler" in entry
    )


def _split_files(folder: Path, split: int, entry: Any) -> SplitFiles:
    if not isinstance(entry, dict):
        raise Damaged(f"run.json: split {split} is not an object")
    training_s = entry.get("training_s")
    split_dir = split_paths.split_dir(folder, split)
    logs = split_paths.logs_dir(folder, split)
    try:
        computational, header = _computational(logs / layout.computational_file(0))
    except FileNotFoundError as exc:
        raise Damaged(f"split {split}: {Path(exc.filename).name} missing") from None
    # summary.log is output: read only for a folder whose run.json predates the figures
    # it states (throughput, records dropped, straggler), never required beside them
    summary = ""
    if not states_figures(entry):
        try:
            summary = (split_dir / layout.SUMMARY_FILE).read_text(
                encoding="utf-8", errors="replace"
            )
        except FileNotFoundError:
            raise Damaged(
                f"split {split}: summary.log missing and run.json states no figures"
            ) from None
        if TITLE_LINE not in summary:
            raise Damaged(f"split {split}: summary.log holds no computational summary")
    try:
        resources = _resources_body(logs / layout.RESOURCES_FILE)
    except FileNotFoundError:  # no sample was taken (a very short run)
        resources = (b"", fields.columns())
    try:
        ranks = (logs / layout.RANKS_FILE).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:  # one rank, or a version before it
        ranks = ""
    nodes = entry.get("nodes")
    # only a split of several nodes has other nodes' files: no listing for the others
    others = (
        sorted(logs.glob(layout.node_resources_file("*")))
        if isinstance(nodes, list) and len(nodes) > 1
        else []
    )
    node_resources = tuple(_resources_body(path) for path in others)
    return SplitFiles(
        split,
        float(training_s) if isinstance(training_s, (int, float)) else 0.0,
        computational,
        header.count(b"\t") + 1,
        *resources,
        summary,
        ranks,
        node_resources,
        entry,
    )


def read_run_folder(folder: Path) -> RunFolder:
    """The files of the run folder ``folder``; raises Damaged with the reason when its
    run.json is unreadable or incomplete, or a split it lists lacks a file or holds a
    truncated or foreign one.
    """
    try:
        meta = json.loads((folder / layout.RUN_FILE).read_bytes())
    except OSError as exc:
        raise Damaged(f"run.json unreadable: {exc.strerror or exc}") from None
    except (ValueError, RecursionError):
        raise Damaged("run.json is not valid JSON (half-written?)") from None
    if not isinstance(meta, dict):
        raise Damaged("run.json is not an object")
    missing = [key for key in REQUIRED_KEYS if key not in meta]
    if missing:
        raise Damaged(f"run.json lacks {', '.join(missing)}")
    if not isinstance(meta["splits"], dict) or not meta["splits"]:
        raise Damaged("run.json lists no split")
    try:
        splits = sorted((int(k), v) for k, v in meta["splits"].items())
    except ValueError:
        raise Damaged("run.json: a split is not numbered") from None
    try:
        return RunFolder(folder, meta, [_split_files(folder, k, v) for k, v in splits])
    except OSError as exc:
        raise Damaged(f"unreadable: {exc.strerror or exc}") from None
