"""The straggler rule on iterations shaped as DDP shapes them: every rank's loop lasts as
long as the slowest one's, the slow rank is slow before the sync, the others wait in
backward."""

from __future__ import annotations

import numpy as np

from sidecar.model.stragglers import RankIterations, straggler_line, stragglers

LOOP_S = 0.100


def ddp_job(
    slow: dict[int, tuple[slice, int, float]], ranks: int = 4, iterations: int = 40, seed: int = 0
) -> dict[int, RankIterations]:
    """Ranks whose phase ``phase`` (index) is ``extra_s`` longer over ``when``
    (``slow[rank] = (when, phase, extra_s)``); the rest of each loop waits in backward."""
    rng = np.random.default_rng(seed)
    base = np.tile([0.010, 0.030, 0.040, 0.010], (ranks, iterations, 1))
    base += rng.normal(0.0, 0.0005, base.shape).clip(-0.002, 0.002)
    for rank, (when, phase, extra_s) in slow.items():
        base[rank, when, phase] += extra_s
    pre_sync = base[:, :, :2].sum(axis=2)
    base[:, :, 2] += pre_sync.max(axis=0) - pre_sync  # waiting for the slowest, in backward
    loops = base.sum(axis=2)
    keys = np.array([(i // 10, i) for i in range(iterations)])
    return {
        rank: RankIterations(f"node{rank // 2}", keys, base[rank], loops[rank])
        for rank in range(ranks)
    }


def test_a_rank_slow_in_forward_is_named_with_its_host_phase_and_margin() -> None:
    view = stragglers(ddp_job({2: (slice(None), 1, 0.030)}))
    assert (view.verdict.rank, view.verdict.host, view.verdict.phase) == (2, "node1", "forward")
    assert abs(view.verdict.over_median_s - 0.030) < 0.003
    assert view.aligned == 40 and view.steady and len(view.windows) == 4
    standing = {s.rank: s for s in view.standings}
    assert standing[2].slowest == 40 and standing[0].slowest == 0
    # the three others wait ~30 ms in each of 40 iterations; the straggler waits for nobody
    assert abs(view.waited_s - 3 * 40 * 0.030) < 0.2 and standing[2].waited_s == 0.0
    line = straggler_line(view)
    assert line.startswith("Straggler: rank 2 on node1, forward, +") and "every window" in line


def test_slow_data_loading_is_told_from_a_slow_forward() -> None:
    view = stragglers(ddp_job({1: (slice(None), 0, 0.020)}))
    assert (view.verdict.rank, view.verdict.phase) == (1, "data loading")


def test_ranks_within_noise_give_none() -> None:
    view = stragglers(ddp_job({}))
    assert view.verdict.rank is None
    assert straggler_line(view).startswith("Straggler: none")


def test_a_culprit_that_changes_is_said_to_change() -> None:
    view = stragglers(ddp_job({1: (slice(0, 20), 1, 0.03), 3: (slice(20, 40), 1, 0.03)}))
    assert view.verdict.rank is None  # neither is slowest in most iterations
    assert [w.rank for w in view.windows] == [1, 1, 3, 3] and not view.steady
    assert straggler_line(view).endswith("by window: rank 1, rank 1, rank 3, rank 3)")


def test_only_iterations_every_rank_has_are_compared() -> None:
    job = ddp_job({0: (slice(None), 1, 0.030)}, ranks=2)
    lost = job[1]
    job[1] = RankIterations(lost.host, lost.keys[5:], lost.phase_s[5:], lost.loop_s[5:])
    view = stragglers(job)
    assert view.aligned == 35 and view.verdict.rank == 0


def test_one_rank_gives_none() -> None:
    view = stragglers({0: ddp_job({})[0]})
    assert view.verdict.rank is None and "fewer than two ranks" in straggler_line(view)
