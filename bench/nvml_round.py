"""What one NVML sampling round costs the sidecar's loop on a node of 8 GPUs.

8 fake Hopper GPUs (GPM on, the job's process on each) whose calls take the time a real
driver takes (``tests.support.fake_pynvml.DRIVER_LATENCY_S``, assumed figures until the
GPU pass measures them), serialised as in the driver. Rounds are stamped 1 s apart (the
default interval), so one in ``SLOW_PERIOD_S`` makes the expensive calls (process lists,
per-process utilization, GPM). Per round: the wall time the loop waits, p50 and p99,
for the cheap rounds and the expensive ones apart; then the same with one GPU whose
memory call takes 3 s: the round stops at its deadline and 7 GPUs keep their samples.

Writes the section "## NVML round on 8 GPUs" of bench/RESULTS.md (``--no-write``: print
only). Run from the repository root: ``python bench/nvml_round.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_section  # noqa: E402
from sidecar.resources.samplers.nvml import SLOW_PERIOD_S, NvmlSampler, open_nvml  # noqa: E402
from tests.support.fake_pynvml import DRIVER_LATENCY_S, MIB, FakeGpu, FakeNvml  # noqa: E402

N_GPUS = 8
ROUND_TIMEOUT_S = 1.0
SLOW_CALL_S = 3.0


def node(latency_s: dict[str, float], serialised: bool = True) -> tuple[FakeNvml, NvmlSampler]:
    """8 fake GPUs as a node shows them to one job's sidecar, opened; ``serialised``: the
    calls of all GPUs take turns in the driver."""
    me = os.getpid()
    gpus = [
        FakeGpu(
            uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
            gpm=True,
            compute_procs=[(me, 1000 * MIB), (1, 10 * MIB)],
            proc_samples=[(me, 2**62, 50)],
        )
        for i in range(N_GPUS)
    ]
    fake = FakeNvml(gpus, latency_s=latency_s, serialised=serialised)
    sampler = open_nvml(None, api=fake, round_timeout_s=ROUND_TIMEOUT_S)
    assert isinstance(sampler, NvmlSampler), sampler
    return fake, sampler


def rounds(sampler: NvmlSampler, n: int, first_s: int = 0) -> tuple[list[float], list[int]]:
    """``n`` rounds stamped 1 s apart: each round's wall time (ms) and sample count."""
    me = {os.getpid()}
    wall_ms, counts = [], []
    for i in range(first_s, first_s + n):
        began = time.perf_counter_ns()
        samples = sampler.sample(me, i * 1_000_000_000)
        wall_ms.append((time.perf_counter_ns() - began) / 1e6)
        counts.append(len(samples))
    return wall_ms, counts


def p50_p99(values: list[float]) -> str:
    return f"{np.percentile(values, 50):.2f} / {np.percentile(values, 99):.2f}"


def measure(n_rounds: int) -> list[tuple[str, str, str]]:
    period = round(SLOW_PERIOD_S)
    rows = []
    for label, latency, serialised in (
        ("driver latencies, calls serialised", DRIVER_LATENCY_S, True),
        ("driver latencies, GPUs in parallel", DRIVER_LATENCY_S, False),
        ("no latency (our Python side)", {}, True),
    ):
        _, sampler = node(latency, serialised)
        wall_ms, counts = rounds(sampler, n_rounds)
        sampler.close()
        assert all(c == N_GPUS for c in counts), counts
        cheap = [w for i, w in enumerate(wall_ms) if i % period]
        slow = [w for i, w in enumerate(wall_ms) if i % period == 0]
        rows.append((f"{label}, cheap rounds ({len(cheap)})", p50_p99(cheap), "8 of 8"))
        rows.append((f"{label}, expensive rounds ({len(slow)})", p50_p99(slow), "8 of 8"))
    fake, sampler = node(DRIVER_LATENCY_S)
    fake.gpus[3].slow = {"nvmlDeviceGetMemoryInfo": SLOW_CALL_S}
    wall_ms, counts = rounds(sampler, 3)
    fake.gpus[3].slow = {}
    fake.release.set()
    sampler.close()
    rows.append(
        (
            f"one GPU's memory call takes {SLOW_CALL_S:g} s (3 rounds)",
            f"{max(wall_ms):.0f} (max)",
            f"{min(counts)}-{max(counts)} of 8",
        )
    )
    return rows


def section(rows: list[tuple[str, str, str]], n_rounds: int) -> str:
    lines = [
        "## NVML round on 8 GPUs",
        "",
        f"`python bench/nvml_round.py`: {N_GPUS} fake Hopper GPUs (GPM, the job's process on "
        "each), every call taking the latency a real driver is assumed to take "
        "(`DRIVER_LATENCY_S` in tests/support/fake_pynvml.py: 25 µs for a cheap call, "
        "0.5 ms for power and a GPM sample, 1 ms for a process list or per-process "
        "utilization; to be replaced by the GPU pass's figures), the calls "
        "serialised in one driver lock or each GPU on its own (which of the two a real "
        "driver does is for the GPU pass to show), one thread per GPU, "
        f"{n_rounds} rounds stamped 1 s apart (the expensive calls every "
        f"{SLOW_PERIOD_S:g} s), deadline {ROUND_TIMEOUT_S:g} s, on {os.cpu_count()} cores at "
        f"a load average of {os.getloadavg()[0]:.1f} (thread hand-offs are what a loaded "
        "machine slows). Wall time the loop waits per round, ms.",
        "",
        "| rounds | p50 / p99 (ms) | GPUs sampled |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--no-write", action="store_true", help="print, do not write")
    args = parser.parse_args()
    text = section(measure(args.rounds), args.rounds)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
