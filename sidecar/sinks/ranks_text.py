"""The ranks of a split as summary.log and ``logs/ranks.tsv`` show them, from the merged
view of every node's figures (``sidecar.model.merge``): the ranks table, the
``Straggler:`` line and what the straggler's GPU showed, the ranks missing or cut off,
the time waited for other nodes, and the other hosts' resources (docs/multi-node.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.model.merge import TABLE_PHASES, MergedSplit
from sidecar.model.straggler_gpu import GpuFigures
from sidecar.sinks import straggler_text
from sidecar.sinks.nodes import NodeFile

RANKS_COLUMNS = (
    "rank",
    "host",
    "status",
    "iterations",
    "measured",
    *(f"{p.summary_label} mean (s)" for p in TABLE_PHASES),
    "slowest",
    "slowest share",
    "over median (s)",
    "phase",
    "waited (s)",
    # its GPU in the iterations it was the slowest (sidecar.model.straggler_gpu)
    "gpu samples",
    "sm clock median (MHz)",
    "sm clock min (MHz)",
    "power mean (W)",
    "temperature max (C)",
    "throttle reasons",
    "cause",
)


def _labels() -> list[str]:
    return [p.summary_label for p in TABLE_PHASES]


def table_lines(view: MergedSplit) -> list[str]:
    """The ranks table (none for fewer than two ranks): stored rows' mean seconds."""
    if len(view.ranks) < 2:
        return []
    labels = _labels()
    widths = [max(10, len(label)) for label in labels]
    out = [
        "Ranks (stored rows, mean s):",
        " | ".join(
            [
                f"{'rank':>6}",
                f"{'iterations':>10}",
                *(f"{label:>{w}}" for label, w in zip(labels, widths, strict=True)),
                "host",
            ]
        ),
    ]
    for figures in view.ranks:
        means = [
            f"{figures.means_s[label]:>{w}.2e}" if label in figures.means_s else " " * w
            for label, w in zip(labels, widths, strict=True)
        ]
        out.append(
            " | ".join([f"{figures.rank:>6}", f"{figures.iterations:>10}", *means, figures.host])
        )
    return out


def rank_lines(view: MergedSplit, world_size: int, waited_s: float | None) -> list[str]:
    """The ranks part of our additions: the table, the ``Straggler:`` line, the ranks whose
    figures never came or whose node did not end them, and the time the summary waited for
    other nodes at the end (``waited_s``; None: it did not wait)."""
    if len(view.ranks) < 2 and world_size < 2:
        return []
    out = table_lines(view)
    if view.stragglers is not None:
        out.append(straggler_text.straggler_line(view.stragglers))
        gpu_line = straggler_text.straggler_gpu_line(view.stragglers)
        out += [gpu_line] if gpu_line is not None else []
    else:
        out.append("Straggler: none (fewer than two ranks measured)")
    if view.missing:
        out.append(
            f"Ranks missing: {', '.join(map(str, view.missing))} of {world_size} "
            "(no figures from their node)"
        )
    for figures in view.ranks:
        if figures.status not in ("running", "completed"):
            out.append(
                f"Rank {figures.rank} on {figures.host}: {figures.status}"
                f"{f' ({figures.cause})' if figures.cause else ''}"
            )
    if waited_s is not None:
        out.append(f"Nodes: waited {waited_s:.2f} s at the end for the other nodes' final figures")
    return out


def ranks_tsv(view: MergedSplit) -> str:
    """The text of ``logs/ranks.tsv``: one row per rank (RANKS_COLUMNS)."""
    standings = {s.rank: s for s in view.stragglers.standings} if view.stragglers else {}
    lines = ["\t".join(RANKS_COLUMNS)]
    for figures in view.ranks:
        standing = standings.get(figures.rank)
        cells = [
            str(figures.rank),
            figures.host,
            figures.status,
            str(figures.iterations),
            str(figures.measured),
            *(
                f"{figures.means_s[label]:.6e}" if label in figures.means_s else ""
                for label in _labels()
            ),
        ]
        if standing is not None:
            cells += [
                str(standing.slowest),
                f"{standing.slowest_share:.4f}",
                f"{standing.over_median_s:.6e}",
                standing.phase or "",
                f"{standing.waited_s:.6e}",
            ]
        else:
            cells += ["", "", "", "", ""]
        cells += _gpu_cells(standing.gpu if standing is not None else None)
        cells.append((figures.cause or "").replace("\t", " ").replace("\n", " "))
        lines.append("\t".join(cells))
    return "\n".join(lines) + "\n"


def _gpu_cells(gpu: GpuFigures | None) -> list[str]:
    """The GPU columns of ranks.tsv: empty for a rank without a GPU; the reasons as
    ``name share`` pairs (0-1) separated by commas, ``none`` when NVML named none, empty
    when it gave no bitmask."""
    if gpu is None:
        return [""] * 6
    return [
        str(gpu.samples),
        *(
            "" if value is None else f"{value:.6g}"
            for value in (
                gpu.sm_clock_median_mhz,
                gpu.sm_clock_min_mhz,
                gpu.power_mean_w,
                gpu.temperature_max_c,
            )
        ),
        (", ".join(f"{name} {share:.3f}" for name, share in gpu.throttle.items()) or "none")
        if gpu.throttle_samples
        else "",
    ]


def host_resource_lines(nodes: Sequence[NodeFile]) -> list[str]:
    """Each other node's resources block, under a line naming its host and ranks."""
    out: list[str] = []
    for node in sorted(nodes, key=lambda n: min((f.rank for f in n.ranks), default=0)):
        ranks = ", ".join(str(f.rank) for f in sorted(node.ranks, key=lambda f: f.rank))
        out += ["", f"Host {node.host} (ranks {ranks}; node {node.node_id})", *node.resources]
    return out
