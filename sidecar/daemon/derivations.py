"""Each split's derived figures (``sidecar.model.derived``) as the loop last computed them:
afresh at every write, handed to the writers; for the published view at most every
``REFRESH_S`` (the straggler rule reads every stored row), handed to the snapshot.

A split whose ranks other sidecars serve too keeps, in the published view, the figures of
its last write (those compared every node's ranks; a refresh here would compare this
node's alone) and is compared live only before its first write.
"""

from __future__ import annotations

import functools
import time

from sidecar.model.derived import SplitFigures, derive
from sidecar.model.split import Split
from sidecar.resources.monitor import ResourceFigures, SplitResources, gpu_readings
from sidecar.sinks import nodes
from sidecar.sinks.nodes import HOSTNAME, NodeFile

# How often the published view reruns the derivation of a split of several ranks, s.
REFRESH_S = 10.0


class Derivations:
    """The latest ``SplitFigures`` of each split, with when (monotonic s) they were
    derived. Loop thread only."""

    def __init__(self) -> None:
        self._latest: dict[Split, tuple[float, SplitFigures]] = {}

    def at_write(
        self, split: Split, resources: ResourceFigures
    ) -> tuple[SplitFigures, list[NodeFile]]:
        """The figures a write of ``split`` lays out, derived now, and the other nodes'
        files read for them (the sidecar serving rank 0 of a split served by several)."""
        others = nodes.read_nodes(split.split_dir) if split.multi_node and 0 in split.ranks else []
        figures = derive(
            split,
            nodes.NODE_ID,
            HOSTNAME,
            resources.gpu_readings,
            [f for node in others for f in node.ranks],
        )
        self._latest[split] = (time.monotonic(), figures)
        return figures, others

    def latest(self, split: Split) -> SplitFigures | None:
        """The figures last derived for ``split`` (None: never)."""
        found = self._latest.get(split)
        return found[1] if found is not None else None

    def live(self, split: Split, resources: SplitResources | None) -> SplitFigures:
        """The figures of ``split`` for the published view: the latest, derived again
        when older than ``REFRESH_S`` for a split of several ranks served here alone, or
        when there are none yet."""
        now_mono = time.monotonic()
        found = self._latest.get(split)
        stale = found is None or (
            now_mono - found[0] >= REFRESH_S and len(split.ranks) > 1 and not split.multi_node
        )
        if found is not None and not stale:
            return found[1]
        samples = (
            functools.partial(gpu_readings, resources.gpu_samples)
            if resources is not None
            else None
        )
        figures = derive(split, nodes.NODE_ID, HOSTNAME, samples)
        self._latest[split] = (now_mono, figures)
        return figures

    def forget(self, split: Split) -> None:
        """Drop what is kept of ``split`` (pruned)."""
        self._latest.pop(split, None)
