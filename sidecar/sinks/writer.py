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

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from sidecar.model import state
from sidecar.model.derived import SplitFigures
from sidecar.model.merge import RankFigures
from sidecar.model.split import RecordCounts, Split
from sidecar.resources.monitor import ResourceFigures
from sidecar.sinks import (
    aggregate_text,
    goodput_text,
    layout,
    nodes,
    ranks_text,
    resources_text,
    rowtext,
    run_file,
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


def _node_text(
    split: Split, own: Sequence[RankFigures], block_lines: list[str], counts: RecordCounts
) -> str:
    """This sidecar's node file of ``split`` (``sinks/nodes.py``): the resources block
    without its title and record lines."""
    return nodes.node_text(
        split.end_unix is not None,
        split.status,
        split.cause,
        split.world_size,
        list(own),
        block_lines[2 : -len(records_lines(counts)) - 1],
        counts.__dict__,
    )


def write_node_file(
    split: Split, own: Sequence[RankFigures], resources: ResourceFigures, counts: RecordCounts
) -> None:
    """Replace only this sidecar's node file of ``split`` with ``own``, the figures of
    the ranks it serves (between the writes of its files, so that a node that dies leaves
    figures of its ranks not older than a few seconds). Raises OSError when it cannot."""
    block_lines = resources_text.resources_block(
        resources.gpus,
        resources.host,
        resources.gpu_off_reason,
        resources.attribution,
        records_lines(counts),
    )
    write_atomic(
        nodes.node_path(split.split_dir),
        _node_text(split, own, block_lines, counts),
    )


def _aggregate(split: Split, resources: ResourceFigures) -> str:
    """aggregate_resource_usage.csv of ``split`` (``sinks/aggregate_text.py``): rank 0's
    allocator peaks on its GPU, every GPU and host sample of the run."""
    uuid = split.rank_gpus.get(0)
    gpu_index = next((s.gpu_index for s in resources.gpu_samples if uuid and s.uuid == uuid), 0)
    rank0 = split.ranks.get(0)
    peaks_mib = rank0.step_peaks_mib() if rank0 is not None else []
    return aggregate_text.aggregate_text(
        resources.gpu_samples,
        resources.host_samples,
        os.cpu_count() or 1,
        {gpu_index: [peak / aggregate_text.MIB_PER_GIB for peak in peaks_mib]},
    )


def render(
    split: Split,
    figures: SplitFigures,
    resources: ResourceFigures,
    counts: RecordCounts,
    with_state: bool,
    on_progress: Progress = lambda what: None,
    others: Sequence[nodes.NodeFile] = (),
) -> tuple[dict[Path, str], list[str] | None]:
    """The files of ``split`` that are replaced whole, with their text, keyed by path, and
    the lines of our summary block (None before any rank reported, or when another
    sidecar serves rank 0); nothing is written. ``figures``: the split's derived figures
    (``sidecar.model.derived``: every rank compared, the goodput accounts, MFU), laid out
    here as they are; ``others``: the other nodes' files its comparison was made with
    (their hosts' resources are shown). ``on_progress(file name)`` is called as each
    text is ready.
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
        if agg.whole_run.rows():  # a run past the cap: its whole-run sample
            files[split.logs_dir / layout.sample_file(agg.rank)] = tables.sample_text(agg)
    multi, leader = split.multi_node, 0 in split.ranks
    view = figures.view
    block = None
    block_lines = resources_text.resources_block(
        resources.gpus,
        resources.host,
        resources.gpu_off_reason,
        resources.attribution,
        records_lines(counts),
    )
    if view is not None:
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
            goodput_text.goodput_lines(figures.accounts, figures.mean_account, figures.mfu),
        )
    if multi:
        files[nodes.node_path(split.split_dir)] = _node_text(
            split, figures.own, block_lines, counts
        )
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
        if leader:
            files[split.logs_dir / aggregate_text.AGGREGATE_FILE] = _aggregate(split, resources)
            on_progress(aggregate_text.AGGREGATE_FILE)
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
    figures: SplitFigures,
    resources: ResourceFigures,
    counts: RecordCounts,
    with_state: bool = False,
    write_bytes: WriteBytes | None = None,
    on_progress: Progress = lambda what: None,
    others: Sequence[nodes.NodeFile] = (),
) -> None:
    """Write all files of ``split`` from its derived ``figures`` (``render``);
    ``with_state`` adds the resume state (checkpoints); ``others`` as in ``render``.
    ``write_bytes`` puts the bytes into an open file (a seam for a full disk in tests);
    ``on_progress(what)`` is called after each step (the server tells a waiting client).

    Raises OSError from the first file that cannot be written; files already replaced
    stay replaced, the others keep their previous content, none is partial.
    """
    seam = {} if write_bytes is None else {"write_bytes": write_bytes}
    files, block = render(split, figures, resources, counts, with_state, on_progress, others)
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
    write_run_file(split, figures, counts, write_bytes)
    split.dirty = False
    split.write_error = None


def write_run_file(
    split: Split,
    figures: SplitFigures,
    counts: RecordCounts,
    write_bytes: WriteBytes | None = None,
) -> None:
    """Merge ``split``'s entry (``sinks/run_file.py``) into its folder's ``run.json`` (the
    last file a write replaces; alone, where the others do not fit, so that an ended run
    never says ``running``). Raises OSError when it cannot be written."""
    seam = {} if write_bytes is None else {"write_bytes": write_bytes}
    run_path = split.out_dir / layout.RUN_FILE
    with folder_lock(split.out_dir):
        text = run_file.run_json(split, figures, counts, run_file.read_text(run_path))
        write_atomic(run_path, text, **seam)
