"""What the GPU pass measures on the device itself, for the figures the code assumes.

    python bench/gpu_probe.py drift --seconds 240 --json FILE   # in the background
    python bench/gpu_probe.py probe [--drift-json FILE] [--section FILE]
    add --fake to either: the same steps on the fakes of tests/support (no GPU)

* NVML call latency per call kind (the first GPU; median and p99 of 200 calls, µs) and
  per sampling round (the sampler over every GPU, 50 rounds: p50 / p99, ms, with and
  without the expensive calls). These replace the assumed ``DRIVER_LATENCY_S``.
* The energy counter's update cadence: the counter polled every ~1 ms for 3 s; the
  median time between its changes (ms). ``MIN_ENERGY_WINDOW_NS`` rests on it.
* The GPU timer's drift against ``perf_counter_ns``: an event recorded and waited for
  every 5 s for ``--seconds``; the slope of GPU time over host time, ppm, and the
  largest residual (µs). The allowance in the markers' GPU-lag estimate rests on it.
* The host cost of the calls a marked GPU phase makes per record:
  ``torch.cuda.current_stream()`` and ``Event.record()`` (µs, medians of 2000). The whole
  marked phase's host cost is ``bench/gpu_overhead.py``'s.

With ``--fake`` every figure is the fakes' (labelled so): it proves the steps run, not the
numbers. Exits 0 when every measurement ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.resources.samplers.nvml import NvmlSampler, open_nvml  # noqa: E402

FAKE_DRIFT_PPM = 50.0  # the fake GPU clock's drift, which --fake must find again
DRIFT_EVERY_S = 5.0


def nvml_api(fake: bool) -> Any:
    """pynvml, or the fake with real-driver latencies and a busy first GPU."""
    if not fake:
        import pynvml

        return pynvml
    from tests.support.fake_pynvml import DRIVER_LATENCY_S, FakeGpu, FakeNvml

    gpus = [FakeGpu(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", gpm=True) for i in range(2)]
    return FakeNvml(gpus, latency_s=DRIVER_LATENCY_S)


def cuda(fake: bool) -> Any:
    """torch.cuda, or the fake whose timer drifts by FAKE_DRIFT_PPM."""
    if not fake:
        import torch

        return torch.cuda
    from tests.support.fake_cuda import FakeCuda

    fake_cuda = FakeCuda(["NVIDIA Fake"])
    fake_cuda.drift_ppm = FAKE_DRIFT_PPM
    return fake_cuda


def timed_us(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        began = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - began) / 1000)
    return out


def nvml_latencies(api: Any) -> list[tuple[str, str]]:
    """Per call kind on the first GPU: median and p99 µs of 200 calls."""
    api.nvmlInit()
    handle = api.nvmlDeviceGetHandleByIndex(0)
    since_us = time.time_ns() // 1000 - 10_000_000
    calls: dict[str, Callable[[], object]] = {
        "nvmlDeviceGetUtilizationRates": lambda: api.nvmlDeviceGetUtilizationRates(handle),
        "nvmlDeviceGetSamples": lambda: api.nvmlDeviceGetSamples(
            handle, api.NVML_GPU_UTILIZATION_SAMPLES, since_us
        ),
        "nvmlDeviceGetMemoryInfo (v2)": lambda: api.nvmlDeviceGetMemoryInfo(
            handle, api.nvmlMemory_v2
        ),
        "nvmlDeviceGetTotalEnergyConsumption": lambda: api.nvmlDeviceGetTotalEnergyConsumption(
            handle
        ),
        "nvmlDeviceGetFieldValues (instant power)": lambda: api.nvmlDeviceGetFieldValues(
            handle, [api.NVML_FI_DEV_POWER_INSTANT]
        ),
        "nvmlDeviceGetPowerUsage": lambda: api.nvmlDeviceGetPowerUsage(handle),
        "nvmlDeviceGetTemperature": lambda: api.nvmlDeviceGetTemperature(
            handle, api.NVML_TEMPERATURE_GPU
        ),
        "nvmlDeviceGetClockInfo": lambda: api.nvmlDeviceGetClockInfo(handle, api.NVML_CLOCK_SM),
        "nvmlDeviceGetComputeRunningProcesses": lambda: api.nvmlDeviceGetComputeRunningProcesses(
            handle
        ),
        "nvmlDeviceGetProcessUtilization": lambda: api.nvmlDeviceGetProcessUtilization(
            handle, since_us
        ),
    }
    rows = []
    for name, call in calls.items():
        try:
            call()
        except Exception as exc:  # a call this GPU does not support: say so, go on
            rows.append((name, f"fails here: {exc}"))
            continue
        times = timed_us(lambda call=call: _quiet(call), 200)
        rows.append((name, f"{statistics.median(times):.1f} / {np.percentile(times, 99):.1f}"))
    return rows


def _quiet(call: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # NOT_FOUND of a sample call: timed all the same
        call()


def nvml_rounds(api: Any) -> list[tuple[str, str]]:
    """The sampler's round over every GPU: p50 / p99 ms of 50 rounds, the expensive calls
    every round and never."""
    rows = []
    for label, period_s in (("every call", 0.0), ("cheap calls only", 1e9)):
        sampler = open_nvml(None, api=api, slow_period_s=period_s)
        if not isinstance(sampler, NvmlSampler):
            return [("round", f"not measured: {sampler.reason}")]
        sampler.sample({0}, time.monotonic_ns())  # the first round makes every call
        times = [
            t / 1000 for t in timed_us(lambda s=sampler: s.sample({0}, time.monotonic_ns()), 50)
        ]
        n = len(sampler.uuids)
        sampler.close()
        rows.append(
            (
                f"round over {n} GPUs, {label}",
                f"{np.median(times):.2f} / {np.percentile(times, 99):.2f} ms",
            )
        )
    return rows


def energy_cadence(api: Any, seconds: float = 3.0) -> str:
    """Median ms between changes of the energy counter, polled every ~1 ms."""
    api.nvmlInit()
    handle = api.nvmlDeviceGetHandleByIndex(0)
    changes = []
    last = api.nvmlDeviceGetTotalEnergyConsumption(handle)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = api.nvmlDeviceGetTotalEnergyConsumption(handle)
        if value != last:
            changes.append(time.monotonic_ns())
            last = value
        time.sleep(0.001)
    gaps = np.diff(changes) / 1e6
    if len(gaps) < 2:
        return f"{len(changes)} changes in {seconds:g} s: too few to tell"
    return (
        f"median {np.median(gaps):.1f} ms between changes ({len(changes)} changes in "
        f"{seconds:g} s; p10-p90 {np.percentile(gaps, 10):.1f}-{np.percentile(gaps, 90):.1f} ms)"
    )


def drift(cuda_api: Any, seconds: float, every_s: float = DRIFT_EVERY_S) -> dict[str, float]:
    """GPU time against perf_counter_ns: an event every ``every_s`` on an idle GPU,
    stamped on the host just before its record (an idle GPU reaches it a constant launch
    latency later; the wake-up after a synchronize is not constant)."""
    cuda_api.synchronize()
    first = cuda_api.Event(enable_timing=True)
    host0 = time.perf_counter_ns()
    first.record()
    first.synchronize()
    points = [(0.0, 0.0)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(every_s, max(0.0, end - time.monotonic())))
        event = cuda_api.Event(enable_timing=True)
        host_s = (time.perf_counter_ns() - host0) / 1e9
        event.record()
        event.synchronize()
        points.append((host_s, first.elapsed_time(event) / 1e3))
    host, gpu = np.array(points).T
    slope, intercept = np.polyfit(host, gpu, 1)
    residual = gpu - (slope * host + intercept)
    return {
        "seconds": float(host[-1]),
        "points": len(points),
        "drift_ppm": float((slope - 1) * 1e6),
        "max_residual_us": float(np.abs(residual).max() * 1e6),
    }


def record_costs(cuda_api: Any) -> list[tuple[str, str]]:
    """Host µs of torch.cuda.current_stream() and of Event.record(), medians of 2000."""
    events = [cuda_api.Event(enable_timing=True) for _ in range(2000)]
    stream = timed_us(cuda_api.current_stream, 2000)
    it = iter(events)
    record = timed_us(lambda: next(it).record(), 2000)
    cuda_api.synchronize()
    return [
        ("torch.cuda.current_stream()", f"{statistics.median(stream):.2f} µs"),
        ("Event.record() (calls current_stream)", f"{statistics.median(record):.2f} µs"),
    ]


def section(fake: bool, drift_figures: dict[str, float] | None) -> str:
    api = nvml_api(fake)
    cuda_api = cuda(fake)
    where = "the fakes (dry run: these are the fakes' figures, not a GPU's)" if fake else "the GPU"
    lines = [
        "### GPU probe",
        "",
        f"`python bench/gpu_probe.py` on {where}.",
        "",
        "| NVML call (first GPU) | median / p99 µs |",
        "|---|---:|",
        *(f"| {a} | {b} |" for a, b in nvml_latencies(api)),
        *(f"| {a} | {b} |" for a, b in nvml_rounds(api)),
        "",
        f"- energy counter: {energy_cadence(api)}",
    ]
    if drift_figures is None:
        lines.append("- GPU timer drift: not measured (no drift run)")
    else:
        lines.append(
            f"- GPU timer drift against perf_counter_ns: {drift_figures['drift_ppm']:+.1f} ppm "
            f"over {drift_figures['seconds']:.0f} s ({drift_figures['points']:.0f} points, "
            f"largest residual {drift_figures['max_residual_us']:.0f} µs)"
        )
    lines += [f"- host cost, {a}: {b}" for a, b in record_costs(cuda_api)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("drift", "probe"))
    parser.add_argument("--fake", action="store_true", help="on the fakes (no GPU)")
    parser.add_argument("--seconds", type=float, default=240.0, help="drift: how long")
    parser.add_argument(
        "--every", type=float, default=DRIFT_EVERY_S, help="drift: seconds between events"
    )
    parser.add_argument("--json", type=Path, help="drift: where to write its figures")
    parser.add_argument("--drift-json", type=Path, help="probe: the drift run's figures")
    parser.add_argument("--section", type=Path, help="probe: also write the section here")
    args = parser.parse_args(argv)
    if args.what == "drift":
        figures = drift(cuda(args.fake), args.seconds, args.every)
        print(json.dumps(figures))
        if args.json:
            args.json.write_text(json.dumps(figures))
        return 0
    figures = None
    if args.drift_json is not None and args.drift_json.exists():
        figures = json.loads(args.drift_json.read_text())
    text = section(args.fake, figures)
    print(text)
    if args.section:
        args.section.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
