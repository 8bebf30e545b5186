"""One split of one run folder: its ranks' aggregators, GPUs, status and record counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sidecar.model import state
from sidecar.model.aggregator import RankAggregator, Settings

# Two orders of the same four statuses, for two questions (later ones win in both):
# - how a split's ranks ended: "running" until one ends, then the worst ending of its
#   ranks; any ending replaces "running", so a rank that completes beats it;
# - how a whole run stands (run.json's top level, the worst of its splits, docs/contract.md):
#   a split still running keeps the run from being completed, so "running" beats
#   "completed" there.
SPLIT_STATUS_ORDER = ("running", "completed", "incomplete", "failed")
RUN_STATUS_ORDER = ("completed", "running", "incomplete", "failed")


def split_dir(out_dir: Path, split: int) -> Path:
    """``<out_dir>/training/split-<split>``: the folder of one split of a run folder."""
    return out_dir / "training" / f"split-{split}"


def logs_dir(out_dir: Path, split: int) -> Path:
    """``<out_dir>/training/split-<split>/logs``."""
    return split_dir(out_dir, split) / "logs"


@dataclass
class RankInfo:
    """A rank served here: the host its process runs on, and how it stands."""

    host: str
    status: str = "running"
    cause: str | None = None


# The key in ``Split.late_nodes`` of the ranks whose node never wrote its node file.
NEVER_WROTE = ""


@dataclass(frozen=True)
class LateNode:
    """A node of the split whose final figures did not come in time: its host (None: a
    node that never wrote its node file, only its ranks are known), the ranks its last
    figures named (or that no node covered), the cause its ranks are written incomplete
    with, and its end as known (Unix s): when it was last heard of (its node file written),
    else when the wait for it ended."""

    host: str | None
    ranks: tuple[int, ...]
    cause: str
    end_unix: float


@dataclass(frozen=True)
class RecordCounts:
    """Record accounting of one split (counts of records, every session's, resumes too)."""

    received: int  # taken here (lost ones not included)
    dropped: int  # not sent: the markers' queue was full or no sidecar listened
    lost: int  # sent, never received
    rejected: int
    gpu_not_measured: int | None  # phases the markers could not time on the GPU; None: no GPU


class Split:
    """Everything the writers need for ``<out_dir>/training/split-<k>/``."""

    def __init__(self, out_dir: Path, split: int, settings: Settings, info: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.split = split
        self.settings = settings
        self.info = info  # run metadata of the hello (host, user, command, versions, ...)
        self.ranks: dict[int, RankAggregator] = {}
        self.gpus: list[tuple[str, str]] = []  # (uuid, name) in order of first use
        # per rank this sidecar serves: the GPU it said it uses (the straggler's GPU
        # figures; a rank that never said is a CPU rank)
        self.rank_gpus: dict[int, str] = {}
        self.status = "running"
        self.cause: str | None = None
        self.end_unix: float | None = None
        self.dropped: dict[str, int] = {}  # per run id (hex): records the markers could not send
        self.lost: dict[str, int] = {}  # per run id: sent but never received here
        self.received: dict[str, int] = {}  # per run id: records taken, lost ones included
        self.gaps: list[tuple[float, float]] = []  # (from, to) Unix s: no sidecar saved
        self.rejected = 0
        self.dirty = True
        self.write_error: str | None = None
        # what the exports wrote and did not write (sidecar.exports), for summary.log
        self.export_lines: list[str] = []
        # The DataLoader settings of the latest train / validation loop (run.json).
        self.loaders: dict[str, dict[str, Any]] = {}
        # Per rank this sidecar serves: its process's host, and its status and cause.
        self.rank_info: dict[int, RankInfo] = {}
        # Served with other sidecars (docs/multi-node.md): the nodes whose final figures
        # did not come in time, and the seconds the end waited for them.
        self.late_nodes: dict[str, LateNode] = {}  # by node id (NEVER_WROTE: no node file)
        self.nodes_waited_s: float | None = None

    @property
    def world_size(self) -> int:
        """The job's ranks as its processes said (``WORLD_SIZE``), at least those seen."""
        said = self.info.get("world_size")
        return max(said if isinstance(said, int) else 1, max(self.ranks, default=-1) + 1)

    @property
    def multi_node(self) -> bool:
        """Whether other sidecars serve ranks of the split: this one lacks rank 0 or some
        of the ranks the job said it has."""
        return 0 not in self.ranks or self.world_size > len(self.ranks)

    def span_unix(self) -> tuple[float | None, float | None]:
        """(start, end) of the ranks served here, Unix s: from the first process's start
        (its time before ``start_run`` included; the hello's start when no rank has a
        session) to the last one's finish or death (None while the split runs). The goodput
        account's wall; run.json and ``/metrics`` state the same instants."""
        aggs = [a for a in self.ranks.values() if a.sessions]
        said = self.info.get("start_unix")
        start_unix = min(
            (a.process_start_unix for a in aggs),
            default=float(said) if isinstance(said, (int, float)) else None,
        )
        last_unix = max((a.sessions[-1].last_unix for a in aggs), default=None)
        end_unix = None if self.end_unix is None else (last_unix or self.end_unix)
        return start_unix, end_unix

    @property
    def split_dir(self) -> Path:
        """``<out_dir>/training/split-<k>``."""
        return split_dir(self.out_dir, self.split)

    @property
    def logs_dir(self) -> Path:
        """``<out_dir>/training/split-<k>/logs``."""
        return logs_dir(self.out_dir, self.split)

    def rank(self, rank: int) -> RankAggregator:
        """The aggregator of ``rank``, created on first use."""
        agg = self.ranks.get(rank)
        if agg is None:
            agg = self.ranks[rank] = RankAggregator(
                rank, self.settings, float(self.info.get("start_unix", 0.0))
            )
        return agg

    def fresh_rank(self, rank: int) -> RankAggregator:
        """A new, empty aggregator for ``rank``, replacing any earlier one."""
        self.ranks.pop(rank, None)
        return self.rank(rank)

    def add_gpu(self, uuid: str, name: str) -> None:
        """Note a GPU used by the split; the same UUID is named once."""
        if all(uuid != known for known, _ in self.gpus):
            self.gpus.append((uuid, name))
            self.dirty = True

    def set_status(self, status: str, cause: str | None) -> None:
        """Record how a rank ended; the worst outcome of all ranks wins."""
        if SPLIT_STATUS_ORDER.index(status) > SPLIT_STATUS_ORDER.index(self.status):
            self.status, self.cause = status, cause
        self.dirty = True

    def record_counts(self) -> RecordCounts:
        """The split's record accounting: ``received`` counts what was taken, so the lost
        records (counted in ``self.received`` to keep the sequence) are taken off."""
        lost = sum(self.lost.values())
        return RecordCounts(
            received=sum(self.received.values()) - lost,
            dropped=sum(self.dropped.values()),
            lost=lost,
            rejected=self.rejected,
            gpu_not_measured=sum(agg.gpu_not_measured for agg in self.ranks.values())
            if self.gpus
            else None,
        )

    def to_state(self, rows_state: state.RowsState | None = None) -> dict[str, Any]:
        """The split's state for ``sidecar.model.state`` (schema there); ``rows_state`` as
        in ``state.rank_state``."""
        return {
            "split": self.split,
            "settings": asdict(self.settings),
            "gpus": [list(g) for g in self.gpus],
            "dropped": self.dropped,
            "lost": self.lost,
            "received": self.received,
            "gaps": [list(g) for g in self.gaps],
            "rejected": self.rejected,
            "ranks": {str(r): state.rank_state(agg, rows_state) for r, agg in self.ranks.items()},
        }

    def load_state(
        self, saved: dict[str, Any], rank: int, continue_run: str = ""
    ) -> RankAggregator:
        """Restore ``rank`` (and the split-wide lists) from a checkpoint's state (current
        schema, see ``sidecar.model.state.upgrade``); ``continue_run`` as in
        ``state.load_rank``.

        Raises KeyError/ValueError/TypeError for a state that does not fit the schema.
        """
        for uuid, name in saved["gpus"]:
            self.add_gpu(str(uuid), str(name))
        self.dropped.update({str(k): int(v) for k, v in saved["dropped"].items()})
        self.lost.update({str(k): int(v) for k, v in saved["lost"].items()})
        self.received.update({str(k): int(v) for k, v in saved["received"].items()})
        self.gaps = [(float(a), float(b)) for a, b in saved["gaps"]]
        self.rejected = max(self.rejected, int(saved["rejected"]))
        agg = self.fresh_rank(rank)
        saved_rank = saved["ranks"].get(str(rank))
        if saved_rank is not None:
            state.load_rank(agg, saved_rank, continue_run)
        return agg
