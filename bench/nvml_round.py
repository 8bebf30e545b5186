"""What one NVML sampling round costs the sidecar's loop on a node of 8 GPUs.

8 fake Hopper GPUs (GPM on, the job's process on each) whose calls take the time a real
driver takes (``tests.support.fake_pynvml.DRIVER_LATENCY_S``, assumed figures until the
GPU pass measures them), serialised as in the driver or each GPU on its own. Rounds are
stamped 1 s apart (the default interval), so one in ``SLOW_PERIOD_S`` makes the
expensive calls (process lists, per-process utilization, GPM). Per round, p50 and p99,
the cheap rounds and the expensive ones apart, three ways in turn on the same sampler
(A B B' A B B' ...):

* waiting (before): ``sample``, the round waited for as the loop did before; the loop
  is stopped that long;
* the loop's way (after): ``start``, then a look (``collect``) every ``LOOK_S`` until the
  round is back, as the loop's turns do; the time spent in those calls is what the loop
  thread pays (the readings run on the GPUs' threads meanwhile), µs;
* the loop's way again: the same code, the noise floor of the pair.

Then one GPU whose memory call takes 3 s: the longest stop of the loop either way, and
how many GPUs each round keeps.

Writes the section "## NVML round on 8 GPUs" of bench/RESULTS.md (``--no-write``: print
only). Run from the repository root: ``python bench/nvml_round.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import load_line  # noqa: E402
from bench.results import write_section  # noqa: E402
from sidecar.resources.samplers.nvml import SLOW_PERIOD_S, NvmlSampler, open_nvml  # noqa: E402
from tests.support.fake_pynvml import DRIVER_LATENCY_S, MIB, FakeGpu, FakeNvml  # noqa: E402

N_GPUS = 8
ROUND_TIMEOUT_S = 1.0
SLOW_CALL_S = 3.0
LOOK_S = 0.002  # between the loop's looks while a round is out (records arriving)
JOB = {os.getpid()}


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


def waited_round(sampler: NvmlSampler, t_ns: int) -> tuple[float, int]:
    """One round waited for (``sample``): the loop's stop (µs) and the samples kept."""
    began = time.perf_counter_ns()
    samples = sampler.sample(JOB, t_ns)
    return (time.perf_counter_ns() - began) / 1e3, len(samples)


def looked_round(sampler: NvmlSampler, t_ns: int) -> tuple[float, int]:
    """One round the loop's way: ``start``, then a look every LOOK_S until it is back;
    the time spent in those calls (µs) and the samples kept."""
    began = time.perf_counter_ns()
    sampler.start(JOB, t_ns)
    spent_ns = time.perf_counter_ns() - began
    while True:
        time.sleep(LOOK_S)  # the loop meanwhile waits on its socket
        began = time.perf_counter_ns()
        rounds = sampler.collect()
        spent_ns += time.perf_counter_ns() - began
        if rounds:
            return spent_ns / 1e3, sum(len(samples) for _, samples in rounds)


WAYS: dict[str, Callable[[NvmlSampler, int], tuple[float, int]]] = {
    "waiting (before)": waited_round,
    "start + looks (after)": looked_round,
    "start + looks, again (noise floor)": looked_round,
}


def p50_p99(values: list[float]) -> str:
    return f"{np.percentile(values, 50):,.0f} / {np.percentile(values, 99):,.0f}"


def measure(n_rounds: int) -> list[tuple[str, str, str]]:
    period = round(SLOW_PERIOD_S)
    rows = []
    for label, latency, serialised in (
        ("calls serialised", DRIVER_LATENCY_S, True),
        ("GPUs in parallel", DRIVER_LATENCY_S, False),
    ):
        _, sampler = node(latency, serialised)
        spent: dict[tuple[str, bool], list[float]] = {}
        for i in range(n_rounds * len(WAYS)):  # A B B' in turn; each way its own rounds
            way = list(WAYS)[i % len(WAYS)]
            us, count = WAYS[way](sampler, i * 1_000_000_000)
            assert count == N_GPUS, (way, count)
            # every fifth stamp makes the expensive calls, each way in turn
            spent.setdefault((way, i % period == 0), []).append(us)
        sampler.close()
        for way in WAYS:
            for slow in (False, True):
                values = spent[(way, slow)]
                kind = "expensive" if slow else "cheap"
                rows.append(
                    (f"{label}, {kind} rounds ({len(values)}), {way}", p50_p99(values), "8 of 8")
                )
    for way, run in list(WAYS.items())[:2]:
        fake, sampler = node(DRIVER_LATENCY_S)
        fake.gpus[3].slow = {"nvmlDeviceGetMemoryInfo": SLOW_CALL_S}
        results = [run(sampler, i * 1_000_000_000) for i in range(3)]
        fake.gpus[3].slow = {}
        fake.release.set()
        sampler.close()
        counts = [count for _, count in results]
        rows.append(
            (
                f"one GPU's memory call takes {SLOW_CALL_S:g} s (3 rounds), {way}",
                f"{max(us for us, _ in results):,.0f} (max)",
                f"{min(counts)}-{max(counts)} of 8",
            )
        )
    return rows


def section(rows: list[tuple[str, str, str]], n_rounds: int, load: str) -> str:
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
        f"{n_rounds} rounds per way stamped 1 s apart (the expensive calls every "
        f"{SLOW_PERIOD_S:g} s), deadline {ROUND_TIMEOUT_S:g} s, on {os.cpu_count()} cores, "
        f"{load}. The three ways take turns on the same sampler. What the loop thread "
        "spends per round, µs: waiting, the whole round (the loop receives nothing "
        f"meanwhile); the loop's way, `start` and the looks (`collect`, one every "
        f"{LOOK_S * 1e3:g} ms until the round is back), the readings running on the GPUs' "
        "threads meanwhile. Thread hand-offs are what a loaded machine slows.",
        "",
        "| rounds | loop's time per round, p50 / p99 (µs) | GPUs sampled |",
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
    before = load_line()
    rows = measure(args.rounds)
    text = section(rows, args.rounds, f"{before} before, {load_line()} after")
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
