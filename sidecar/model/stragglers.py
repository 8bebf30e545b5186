"""Which rank holds the others back: iterations aligned across ranks by (epoch, iteration),
each phase compared with its median across ranks.

Under DDP every rank's iteration lasts as long as the slowest one's, because the gradient
all-reduce waits for it: the loop times agree and tell nothing. What differs is where the
time goes. The straggler is slow *before* the sync (data loading, forward); the others
reach the sync early and wait inside backward. So the rule compares the time before the
sync, ``data loading + forward``, across ranks, iteration by iteration:

* in an aligned iteration, the rank with the longest time before the sync is *the slowest*
  when it exceeds the median across ranks by more than ``MARGIN_SHARE`` of the
  iteration's median loop time (and at least ``MIN_MARGIN_S``);
* a rank is named *the straggler* when it is the slowest in more than ``MAJORITY`` of the
  aligned iterations; the phase that makes the difference is the one, among data loading,
  forward, backward and optimization, whose excess over its median across ranks is the
  largest in those iterations;
* the same rule runs on ``WINDOWS`` consecutive windows of the aligned iterations, which
  says whether the culprit stayed the same over the run;
* the other ranks *wait* for the slowest one, in each iteration where one is found, by the
  difference of their time before the sync and its time;
* what each rank's GPU showed (``sidecar.model.straggler_gpu``): over the iterations in
  which it was the slowest, and over every aligned iteration; beside the straggler's, the
  other ranks' GPUs pooled over the same iterations (the straggler's own run would be
  mostly those iterations: the others are the comparison that tells).

All times in seconds. Only iterations present for every rank take part (the stored rows:
the caps bound them); ``aligned`` says how many there were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from markers import wire
from sidecar.model.straggler_gpu import GpuFigures, GpuReadings, over

# The phases compared (the step parts), in the order of the arrays handed in.
PHASES: tuple[str, ...] = tuple(p.summary_label.lower() for p in wire.STEP_PHASES)
# Their positions before the all-reduce (data loading and forward).
PRE_SYNC = tuple(i for i, p in enumerate(wire.STEP_PHASES) if p.before_sync)
MARGIN_SHARE = 0.10
MIN_MARGIN_S = 0.001
MAJORITY = 0.5
WINDOWS = 4
MIN_WINDOW_ITERATIONS = 5


@dataclass(frozen=True)
class RankIterations:
    """One rank's measured iterations: ``keys`` is an (n, 2) int array of (epoch,
    iteration); ``phase_s`` an (n, len(PHASES)) float array of the PHASES' seconds (0 where the
    phase did not run); ``loop_s`` the (n,) Training loop seconds; ``gpu`` its GPU's
    samples inside those iterations (None: the rank reported no GPU)."""

    host: str
    keys: np.ndarray
    phase_s: np.ndarray
    loop_s: np.ndarray
    gpu: GpuReadings | None = None


@dataclass(frozen=True)
class RankStanding:
    """How one rank compares with the others over the aligned iterations."""

    rank: int
    host: str
    slowest: int  # aligned iterations in which it was the slowest, by the margin
    slowest_share: float  # slowest / aligned
    over_median_s: float  # its mean excess before the sync, over those iterations
    phase: str | None  # the phase with the largest excess in those iterations
    waited_s: float  # its time spent waiting for the slowest rank, summed
    # its GPU in the iterations it was the slowest, and in every aligned iteration (None:
    # the rank reported no GPU)
    gpu: GpuFigures | None = None
    gpu_aligned: GpuFigures | None = None


@dataclass(frozen=True)
class Verdict:
    """The straggler (``rank`` None: none) over some aligned iterations."""

    rank: int | None
    host: str | None
    phase: str | None
    over_median_s: float
    share: float  # of the iterations in which it was the slowest
    first: tuple[int, int] | None  # (epoch, iteration) of the first aligned iteration
    last: tuple[int, int] | None


@dataclass(frozen=True)
class Stragglers:
    """The whole view: per-rank standings, the verdict over the run and per window, and
    the median loop time of the aligned iterations; ``others_gpu`` the other ranks' GPUs
    pooled over the straggler's slowest iterations (None: no straggler, or none of the
    others reported a GPU)."""

    aligned: int
    standings: list[RankStanding]
    verdict: Verdict
    windows: list[Verdict]
    median_loop_s: float
    others_gpu: GpuFigures | None = None

    @property
    def steady(self) -> bool:
        """The same verdict in every window (True with fewer than two windows)."""
        return len({window.rank for window in self.windows}) <= 1

    @property
    def waited_s(self) -> float:
        """Time all ranks together spent waiting for the slowest one, summed."""
        return sum(standing.waited_s for standing in self.standings)


def _key(row: np.ndarray) -> tuple[int, int]:
    return int(row[0]), int(row[1])


def _align(
    ranks: Mapping[int, RankIterations],
) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """The ranks in order, the common keys, phases (ranks, n, len(PHASES)) and loops (ranks, n)."""
    order = sorted(ranks)
    common: set[tuple[int, int]] | None = None
    for rank in order:
        keys = {_key(key) for key in ranks[rank].keys}
        common = keys if common is None else common & keys
    shared = sorted(common or ())
    phases = np.zeros((len(order), len(shared), len(PHASES)))
    loops = np.zeros((len(order), len(shared)))
    for index, rank in enumerate(order):
        data = ranks[rank]
        position = {_key(key): row for row, key in enumerate(data.keys)}
        rows = [position[key] for key in shared]
        phases[index] = data.phase_s[rows] if rows else phases[index]
        loops[index] = data.loop_s[rows] if rows else loops[index]
    return order, np.array(shared, dtype=np.int64).reshape(-1, 2), phases, loops


def _verdict(
    order: Sequence[int],
    hosts: Sequence[str],
    keys: np.ndarray,
    phases: np.ndarray,
    loops: np.ndarray,
) -> tuple[Verdict, np.ndarray, np.ndarray]:
    """The verdict over these iterations, with the per-iteration slowest rank index (-1
    where none is clear) and each rank's excess before the sync."""
    count = keys.shape[0]
    if count == 0 or len(order) < 2:
        return (
            Verdict(None, None, None, 0.0, 0.0, None, None),
            np.full(count, -1),
            np.zeros((len(order), count)),
        )
    pre_sync = phases[:, :, list(PRE_SYNC)].sum(axis=2)
    excess = pre_sync - np.median(pre_sync, axis=0)
    candidate = np.argmax(pre_sync, axis=0)
    margin = np.maximum(MARGIN_SHARE * np.median(loops, axis=0), MIN_MARGIN_S)
    clear = excess[candidate, np.arange(count)] > margin
    slowest = np.where(clear, candidate, -1)
    counts = np.bincount(slowest[slowest >= 0], minlength=len(order))
    top = int(np.argmax(counts))
    share = float(counts[top]) / count
    first, last = _key(keys[0]), _key(keys[-1])
    if share <= MAJORITY:
        return Verdict(None, None, None, 0.0, share, first, last), slowest, excess
    mine = slowest == top
    phase_excess = phases[top, mine] - np.median(phases[:, mine], axis=0)
    phase = PHASES[int(np.argmax(phase_excess.mean(axis=0)))]
    verdict = Verdict(
        order[top], hosts[top], phase, float(excess[top, mine].mean()), share, first, last
    )
    return verdict, slowest, excess


def stragglers(ranks: Mapping[int, RankIterations]) -> Stragglers:
    """Compare the ranks (at least two for a verdict); see the module's rule."""
    order, keys, phases, loops = _align(ranks)
    hosts = [ranks[rank].host for rank in order]
    verdict, slowest, excess = _verdict(order, hosts, keys, phases, loops)
    pre_sync = phases[:, :, list(PRE_SYNC)].sum(axis=2)
    readings = [ranks[rank].gpu for rank in order]
    every = np.ones(len(keys), dtype=bool)
    standings = []
    for index, rank in enumerate(order):
        mine = slowest == index
        gpu = readings[index]
        others = slowest >= 0
        waited = (
            (pre_sync[slowest[others], np.flatnonzero(others)] - pre_sync[index, others])
            .clip(min=0)
            .sum()
            if others.any()
            else 0.0
        )
        phase = None
        if mine.any():
            phase_excess = phases[index, mine] - np.median(phases[:, mine], axis=0)
            phase = PHASES[int(np.argmax(phase_excess.mean(axis=0)))]
        standings.append(
            RankStanding(
                rank,
                hosts[index],
                int(mine.sum()),
                float(mine.sum()) / len(keys) if len(keys) else 0.0,
                float(excess[index, mine].mean()) if mine.any() else 0.0,
                phase,
                float(waited),
                None if gpu is None else over([gpu], keys, mine),
                None if gpu is None else over([gpu], keys, every),
            )
        )
    windows: list[Verdict] = []
    if len(keys) >= WINDOWS * MIN_WINDOW_ITERATIONS:
        for part in np.array_split(np.arange(len(keys)), WINDOWS):
            windows.append(_verdict(order, hosts, keys[part], phases[:, part], loops[:, part])[0])
    median_loop_s = float(np.median(loops)) if loops.size else 0.0
    others_gpu = None
    if verdict.rank is not None:
        culprit = order.index(verdict.rank)
        theirs = [r for i, r in enumerate(readings) if i != culprit and r is not None]
        others_gpu = over(theirs, keys, slowest == culprit) if theirs else None
    return Stragglers(len(keys), standings, verdict, windows, median_loop_s, others_gpu)
