"""The straggler rule on iterations shaped as DDP shapes them: every rank's loop lasts as
long as the slowest one's, the slow rank is slow before the sync, the others wait in
backward."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sidecar.model.straggler_gpu import GpuReadings, reason_names
from sidecar.model.stragglers import (
    PHASES,
    RankIterations,
    stragglers,
)
from sidecar.sinks.straggler_text import straggler_gpu_line, straggler_line

LOOP_S = 0.100
# Each step part's seconds in an iteration (a step part not named here takes none).
STEP_S = {"data loading": 0.010, "forward": 0.030, "backward": 0.040, "optimization": 0.010}
LOADING, FORWARD, BACKWARD = (
    PHASES.index(name) for name in ("data loading", "forward", "backward")
)


def ddp_job(
    slow: dict[int, tuple[slice, int, float]], ranks: int = 4, iterations: int = 40, seed: int = 0
) -> dict[int, RankIterations]:
    """Ranks whose phase ``phase`` (index) is ``extra_s`` longer over ``when``
    (``slow[rank] = (when, phase, extra_s)``); the rest of each loop waits in backward."""
    rng = np.random.default_rng(seed)
    base = np.tile([STEP_S.get(name, 0.0) for name in PHASES], (ranks, iterations, 1))
    base += rng.normal(0.0, 0.0005, base.shape).clip(-0.002, 0.002)
    for rank, (when, phase, extra_s) in slow.items():
        base[rank, when, phase] += extra_s
    pre_sync = base[:, :, [LOADING, FORWARD]].sum(axis=2)
    base[:, :, BACKWARD] += pre_sync.max(axis=0) - pre_sync  # waiting for the slowest
    loops = base.sum(axis=2)
    keys = np.array([(i // 10, i) for i in range(iterations)])
    return {
        rank: RankIterations(f"node{rank // 2}", keys, base[rank], loops[rank])
        for rank in range(ranks)
    }


def test_a_rank_slow_in_forward_is_named_with_its_host_phase_and_margin() -> None:
    view = stragglers(ddp_job({2: (slice(None), FORWARD, 0.030)}))
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
    view = stragglers(ddp_job({1: (slice(None), LOADING, 0.020)}))
    assert (view.verdict.rank, view.verdict.phase) == (1, "data loading")


def test_ranks_within_noise_give_none() -> None:
    view = stragglers(ddp_job({}))
    assert view.verdict.rank is None
    assert straggler_line(view).startswith("Straggler: none")


def test_a_culprit_that_changes_is_said_to_change() -> None:
    view = stragglers(
        ddp_job({1: (slice(0, 20), FORWARD, 0.03), 3: (slice(20, 40), FORWARD, 0.03)})
    )
    assert view.verdict.rank is None  # neither is slowest in most iterations
    assert [w.rank for w in view.windows] == [1, 1, 3, 3] and not view.steady
    assert straggler_line(view).endswith("by window: rank 1, rank 1, rank 3, rank 3)")


def test_only_iterations_every_rank_has_are_compared() -> None:
    job = ddp_job({0: (slice(None), FORWARD, 0.030)}, ranks=2)
    lost = job[1]
    job[1] = RankIterations(lost.host, lost.keys[5:], lost.phase_s[5:], lost.loop_s[5:])
    view = stragglers(job)
    assert view.aligned == 35 and view.verdict.rank == 0


def test_one_rank_gives_none() -> None:
    view = stragglers({0: ddp_job({})[0]})
    assert view.verdict.rank is None and "fewer than two ranks" in straggler_line(view)


def _readings(keys: np.ndarray, values: np.ndarray) -> GpuReadings:
    """One sample per iteration of ``keys`` with the (n, 4) ``values``."""
    return GpuReadings(keys, values)


def test_a_throttled_straggler_gets_its_gpu_figures_beside_the_others() -> None:
    job = ddp_job({2: (slice(10, None), LOADING, 0.030)})  # slow data loading from iteration 10
    normal = np.tile([1980.0, 300.0, 60.0, 0.0], (40, 1))
    throttled = normal.copy()
    # while it is slow its GPU throttles (hw slowdown + hw thermal); before, it was fine
    throttled[10:] = [1100.0, 150.0, 88.0, 0x8 | 0x40]
    throttled[25:, 0] = 900.0
    for rank in (0, 1):
        job[rank] = replace(job[rank], gpu=_readings(job[rank].keys, normal))
    job[2] = replace(job[2], gpu=_readings(job[2].keys, throttled))
    # rank 3 reported no GPU: no readings (None), never zeros
    view = stragglers(job)
    assert view.verdict.rank == 2
    standing = {s.rank: s for s in view.standings}
    gpu = standing[2].gpu
    assert gpu is not None and gpu.samples == standing[2].slowest == 30
    assert (gpu.sm_clock_median_mhz, gpu.sm_clock_min_mhz) == (1000.0, 900.0)
    assert (gpu.power_mean_w, gpu.temperature_max_c) == (150.0, 88.0)
    assert gpu.throttle == {"hw_slowdown": 1.0, "hw_thermal_slowdown": 1.0}
    # over every aligned iteration (what /metrics exports) the fine half counts too
    aligned = standing[2].gpu_aligned
    assert aligned is not None and aligned.samples == 40
    assert aligned.throttle == {"hw_slowdown": 0.75, "hw_thermal_slowdown": 0.75}
    assert standing[3].gpu is None and standing[3].gpu_aligned is None
    assert view.others_gpu is not None and view.others_gpu.samples == 60  # ranks 0 and 1
    line = straggler_gpu_line(view)
    assert line == (
        "Straggler GPU: rank 2 in its 30 slowest iterations (30 samples): SM clock median "
        "1000 MHz (min 900), power mean 150.0 W, temperature max 88 °C, throttle reasons "
        "hw_slowdown (100 %), hw_thermal_slowdown (100 %); the other ranks' GPUs then "
        "(60 samples): SM clock median 1980 MHz (min 1980), power mean 300.0 W, "
        "temperature max 60 °C, throttle reasons none"
    )


def test_a_cpu_straggler_is_said_to_have_no_gpu_figures() -> None:
    view = stragglers(ddp_job({1: (slice(None), LOADING, 0.020)}))
    assert view.verdict.rank == 1 and view.others_gpu is None
    assert all(s.gpu is None for s in view.standings)
    assert straggler_gpu_line(view) == (
        "Straggler GPU: none (rank 1 reported no GPU: its figures are CPU only)"
    )
    assert straggler_gpu_line(stragglers(ddp_job({}))) is None  # no straggler, no line


def test_throttle_reasons_are_named_and_unknown_bits_kept() -> None:
    assert reason_names(0) == []
    assert reason_names(0x1 | 0x200) == ["gpu_idle", "board_limit"]
    assert reason_names(0x48 | 0x1800) == ["hw_slowdown", "hw_thermal_slowdown", "0x1800"]
