"""A split's derived figures, computed once per write (and, throttled, for the live view):
every rank compared (the straggler rule run once), each rank's wait for the slowest one,
the goodput accounts that include that wait, and the MFU estimate. Nothing is stored on
the ``Split``: the writers and the snapshot are handed the ``SplitFigures``.

Which ranks are compared: the sidecar serving rank 0 merges its own ranks with the other
nodes' figures (``sidecar.model.merge``, docs/multi-node.md) and compares them all; a
sidecar without rank 0 compares the ranks it serves (its waits only: the summary is rank
0's sidecar's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from sidecar.model.efficiency import mean, rank_iterations, split_mfu, waits_per_iteration
from sidecar.model.goodput import Account
from sidecar.model.merge import MergedSplit, RankFigures, figures_of, merged
from sidecar.model.peaks import Mfu
from sidecar.model.split import Split
from sidecar.model.stragglers import RankStanding, Stragglers, stragglers

# The samples of a GPU (by UUID) taken in a span of this host's monotonic clock (from_ns,
# to_ns): rows of t_ns, then straggler_gpu.READING_COLUMNS (``merge.figures_of``)
GpuSamples = Callable[[str, int, int], np.ndarray]


@dataclass(frozen=True)
class SplitFigures:
    """What a split's stored rows and its nodes' figures derive to at one moment.

    ``own``: the figures of the ranks this sidecar serves (empty for a lone rank on one
    node, which nothing compares); ``view``: every rank of the split merged and compared
    (only on the sidecar serving rank 0; None elsewhere or before any rank);
    ``waits_s``: per rank, the seconds it waited for the slowest rank per aligned
    iteration; ``accounts``: the goodput account of each rank served here with a session,
    that wait included; ``mean_account``: their mean, the split's account (None without
    any); ``mfu``: the MFU estimate (None without FLOPs per batch).
    """

    own: tuple[RankFigures, ...]
    view: MergedSplit | None
    waits_s: Mapping[int, float]
    accounts: Mapping[int, Account]
    mean_account: Account | None
    mfu: Mfu | None

    @property
    def stragglers(self) -> Stragglers | None:
        """Every rank compared (None: fewer than two ranks, or not rank 0's sidecar)."""
        return self.view.stragglers if self.view is not None else None

    @property
    def standings(self) -> tuple[RankStanding, ...]:
        """Each rank's standing in the comparison (none without one)."""
        return tuple(self.stragglers.standings) if self.stragglers is not None else ()


def own_figures(
    split: Split, node_id: str, host: str, gpu_samples: GpuSamples | None = None
) -> list[RankFigures]:
    """The figures of the ranks this sidecar serves (``node_id``; ``host``: a rank's host
    when its process did not say), with the samples of the GPU each reported."""
    out = []
    for rank in sorted(split.ranks):
        info = split.rank_info.get(rank)
        uuid = split.rank_gpus.get(rank)
        out.append(
            figures_of(
                split.ranks[rank],
                info.host if info else host,
                node_id,
                info.status if info else split.status,
                info.cause if info else split.cause,
                uuid,
                functools.partial(gpu_samples, uuid)
                if uuid is not None and gpu_samples is not None
                else None,
            )
        )
    return out


def _late(split: Split, others: Sequence[RankFigures]) -> list[RankFigures]:
    """``others`` with the running ranks of a node that sent no final figures in time
    made incomplete, with the cause."""
    out = []
    for figures in others:
        late = split.late_nodes.get(figures.node_id)
        if late is not None and figures.status == "running":
            figures = replace(figures, status="incomplete", cause=late.cause)
        out.append(figures)
    return out


def derive(
    split: Split,
    node_id: str = "",
    host: str = "",
    gpu_samples: GpuSamples | None = None,
    others: Sequence[RankFigures] = (),
) -> SplitFigures:
    """The derived figures of ``split`` (see ``SplitFigures``); ``node_id``, ``host``,
    ``gpu_samples`` as in ``own_figures``; ``others``: the ranks' figures other nodes
    wrote, the newest first (read by the sidecar serving rank 0 only).

    The straggler rule runs once: over every rank when this sidecar serves rank 0 (the
    ranks without a session too: they hold no iteration, so none is aligned), else over
    the ranks served here that have a session.
    """
    aggs = [split.ranks[r] for r in sorted(split.ranks)]
    counted = [agg for agg in aggs if agg.sessions]
    own = (
        own_figures(split, node_id, host, gpu_samples) if split.multi_node or len(aggs) > 1 else []
    )
    view = (
        merged(own, _late(split, others), split.world_size) if aggs and 0 in split.ranks else None
    )
    compared: Stragglers | None = None
    if view is not None:
        compared = view.stragglers
    elif len(counted) > 1:
        compared = stragglers({agg.rank: rank_iterations(agg) for agg in counted})
    waits = waits_per_iteration(compared, [agg.rank for agg in counted])
    flops = split.info.get("flops_per_batch")
    accounts = {agg.rank: agg.goodput_account(waits.get(agg.rank, 0.0)) for agg in counted}
    return SplitFigures(
        tuple(own),
        view,
        waits,
        accounts,
        mean([accounts[r] for r in sorted(accounts)]) if accounts else None,
        split_mfu(
            aggs,
            float(flops) if isinstance(flops, (int, float)) else None,
            str(split.info.get("flops_dtype") or "bf16"),
            split.gpus[0][1] if split.gpus else None,
        ),
    )
