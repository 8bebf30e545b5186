"""The GPU-start lag on the fake's clock driven for hours: a loop that never lets the GPU
idle keeps its lag (the estimate falls only as fast as the measured drift of the GPU
clock against the host's), and elapsed times from a renewed anchor keep their precision
although CUDA gives them in float32 milliseconds."""

from __future__ import annotations

import statistics

import pytest

from markers.gpu import GpuTimer
from tests.support.fake_cuda import FakeBackend

HOUR_NS = 3600 * 10**9
STEP_NS = 500_000_000  # one phase every 0.5 s of host time
PHASE_NS = 100_000_000  # of 0.1 s on the GPU


def drive(hours: float, lag_ms: float, drift_ppm: float) -> tuple[GpuTimer, list[float]]:
    """A loop whose GPU starts each phase ``lag_ms`` after the host launched it (the GPU
    idle only when timing began), on a GPU clock running ``drift_ppm`` fast, for
    ``hours`` of host time; returns the timer and the error (ms) of each phase's lag."""
    fake = FakeBackend()
    fake.float32 = True
    host = [1_000 * 10**9]  # host perf_counter_ns
    origin_ns = host[0]

    def gpu_ms(host_ns: int) -> float:  # the GPU's clock when the host's reads host_ns
        return (host_ns - origin_ns) * (1 + drift_ppm * 1e-6) / 1e6 + 5_000.0

    lag_ns = round(lag_ms * 1e6)
    fake.clock_ms = gpu_ms(host[0])  # the anchor: the GPU idle, it runs when recorded
    timer = GpuTimer(fake, pool_size=4, now_ns=lambda: host[0])
    errors_ms: list[float] = []
    while host[0] - origin_ns < hours * HOUR_NS:
        host[0] += STEP_NS
        start_ns = host[0]
        fake.clock_ms = gpu_ms(start_ns + lag_ns)
        slot = timer.begin()
        fake.clock_ms = gpu_ms(start_ns + lag_ns + PHASE_NS)
        timer.end(slot)
        fake.done = fake.recorded  # the GPU passed them by the next poll
        host[0] += 1_000_000
        fake.clock_ms = gpu_ms(host[0] + lag_ns)  # what the loop queues now runs that late
        result = timer.poll(slot, start_ns)
        assert result is not None
        errors_ms.append((result[2] - lag_ns) / 1e6)
    return timer, errors_ms


def test_the_lag_of_a_loop_ahead_of_its_gpu_holds_for_hours() -> None:
    """50 ms behind for 4 hours on clocks that agree: the lag reads 50 ms at the end (an
    assumed 100 ppm allowance read 0 after 500 s); no drift is measured."""
    timer, errors_ms = drive(4, 50.0, 0.0)
    late = errors_ms[-720:]  # the last hour
    assert max(abs(e) for e in late) < 0.1, (min(late), max(late))
    assert timer.drift_per_ns == pytest.approx(0.0, abs=1e-7)


def test_a_gpu_clock_running_fast_is_measured_and_followed() -> None:
    """The GPU's clock 20 ppm fast: over 4 hours an estimate that never fell would read the
    lag 0.29 s too long; the drift is measured (20 ppm) and the lag stays right."""
    timer, errors_ms = drive(4, 50.0, 20.0)
    assert timer.drift_per_ns * 1e6 == pytest.approx(20.0, rel=0.05)
    late = errors_ms[-720:]
    assert max(abs(e) for e in late) < 1.0, (min(late), max(late))


def test_elapsed_times_keep_their_precision_after_a_day() -> None:
    """A day from one anchor, float32 milliseconds step by 8 ms; from an anchor renewed
    every minute, the lag's error stays within microseconds."""
    _, errors_ms = drive(24, 50.0, 0.0)
    late = errors_ms[-720:]
    assert statistics.median(abs(e) for e in late) < 0.05, statistics.median(late)
    assert max(abs(e) for e in late) < 0.2, (min(late), max(late))
