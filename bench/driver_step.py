"""The loop driver's cost per step, C step against Python step, warm.

    python bench/driver_step.py [--n 20000] [--repeats 15] [--no-write]

``for batch in run.train_batches(loader): pass`` over a loader of ready ``(inputs,
labels)`` tensor pairs (a list: the loader itself costs a list step), a real sidecar
listening, torch imported. Side by side in one process, interleaved, medians of repeats:

* the bare loop over the same list (subtracted from the others: 'net');
* the driver on the C step (``markers._speedups.DriverBase``) twice: A and A', their
  difference is the noise floor;
* the driver on the Python step (``markers.driver.PureStep``).

Python frames per step are counted with ``sys.setprofile`` ('call' events over a timed
loop, divided by its steps): the driver's own and the batch size reader's. Writes
``## Loop driver step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
perf_counter = time.perf_counter
thread_time = time.thread_time

BARE = "bare loop over the loader"
C_STEP = "driver, C step"
C_AGAIN = "driver, C step again (A/A)"
PY_STEP = "driver, Python step"


Loop = Callable[[list[Any]], tuple[float, float]]  # (wall, thread CPU) seconds
Times = dict[str, list[tuple[float, float]]]  # (wall, thread CPU) ns per step by variant


def driven(run: Any, kind: type) -> Loop:
    """A timed loop of ``run``'s driver built on ``kind``: seconds for the whole loader."""
    import markers.run as run_module

    def loop(loader: list[Any]) -> tuple[float, float]:
        run_module.Driver = kind  # type: ignore[attr-defined]
        start, cpu = perf_counter(), thread_time()
        for _ in run.train_batches(loader):
            pass
        return perf_counter() - start, thread_time() - cpu

    return loop


def bare(loader: list[Any]) -> tuple[float, float]:
    start, cpu = perf_counter(), thread_time()
    for _ in loader:
        pass
    return perf_counter() - start, thread_time() - cpu


def frames_per_step(loop: Loop, loader: list[Any]) -> float:
    """Python frames entered per step of ``loop`` (the loop's own start and end spread
    over the steps, ~0.01 a step at 1000 steps)."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        loop(loader)
    finally:
        sys.setprofile(None)
    return calls / len(loader)


def measure(run: Any, n: int, repeats: int) -> tuple[Times, dict[str, float]]:
    """(wall, thread CPU) ns per step of each variant in each repeat, and Python frames
    per step."""
    import torch

    from markers import driver

    compiled = driver.accelerated_driver()
    if compiled is None:
        raise SystemExit("markers._speedups has no DriverBase: build it (setup.py build_ext)")
    pair = (torch.zeros(32, 64), torch.zeros(32, dtype=torch.long))
    loader = [pair] * n
    variants = {
        BARE: bare,
        C_STEP: driven(run, compiled),
        C_AGAIN: driven(run, compiled),
        PY_STEP: driven(run, driver.PureDriver),
    }
    frames = {name: frames_per_step(loop, loader[:1000]) for name, loop in variants.items()}
    for loop in variants.values():  # warm up: specialization, first sends
        loop(loader[: n // 10])
    times: Times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, loop in variants.items():
            wall, cpu = loop(loader)
            times[name].append((wall / n * 1e9, cpu / n * 1e9))
    return times, frames


def _net(times: Times, which: int) -> dict[str, list[float]]:
    """ns per step over the bare loop's in the same repeat (``which``: 0 wall, 1 CPU)."""
    base = [t[which] for t in times[BARE]]
    return {
        name: [t[which] - b for t, b in zip(values, base, strict=True)]
        for name, values in times.items()
    }


def _floor(net: dict[str, list[float]]) -> float:
    """The noise floor: median |A - A'| of the two C rows, µs."""
    pairs = zip(net[C_STEP], net[C_AGAIN], strict=True)
    return statistics.median(abs(a - b) for a, b in pairs) / 1e3


def section(
    times: Times, frames: dict[str, float], n: int, repeats: int, dropped: int
) -> tuple[str, dict[str, float]]:
    """The ``## Loop driver step`` section and the headline figures."""
    from bench.common import load_line, spread
    from bench.results import machine_line

    wall, cpu = _net(times, 0), _net(times, 1)
    us = {
        (name, clock): statistics.median(net[name]) / 1e3
        for name in times
        for clock, net in (("wall", wall), ("cpu", cpu))
    }
    ratios = [p / c for p, c in zip(cpu[PY_STEP], cpu[C_STEP], strict=True) if c > 0]
    lines = [
        "## Loop driver step",
        "",
        machine_line("python bench/driver_step.py") + f" {load_line()} at the end. "
        f"torch imported; `for batch in run.train_batches(loader): pass` over {n} ready "
        f"`(inputs, labels)` tensor pairs per block, {repeats} interleaved repeats; per "
        "step, on the wall clock and on the thread's CPU clock (`time.thread_time`, which "
        "a busy neighbour disturbs less): median (min–max); 'net' subtracts the bare "
        "loop's time in the same repeat; a real sidecar listening; frames: Python frames "
        "entered per step (`sys.setprofile`).",
        "",
        "| variant | wall per step (ns) | CPU per step (ns) | net wall / CPU (µs) "
        "| Python frames per step |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, values in times.items():
        net_cell = "" if name == BARE else f"{us[name, 'wall']:.2f} / {us[name, 'cpu']:.2f}"
        lines.append(
            f"| {name} | {spread([t[0] for t in values])} | {spread([t[1] for t in values])} "
            f"| {net_cell} | {frames[name]:.2f} |"
        )
    lines += [
        "",
        f"- C step: **{us[C_STEP, 'cpu']:.2f} µs CPU** ({us[C_STEP, 'wall']:.2f} µs wall) "
        f"and {frames[C_STEP]:.2f} frames a step; Python step: {us[PY_STEP, 'cpu']:.2f} µs "
        f"CPU ({us[PY_STEP, 'wall']:.2f} µs wall) and {frames[PY_STEP]:.2f} frames "
        f"(Python / C, CPU, per repeat: median {statistics.median(ratios):.2f}×); noise "
        f"floor (|A − A'|, median): {_floor(cpu):.2f} µs CPU, {_floor(wall):.2f} µs wall",
        "- the C step's remaining frames are its flushes' (one message every 1024 slots); "
        "the Python step's: the step, the batch size reader (two), the step end, the "
        "loop record and next context (three), the data loading slot",
        f"- records the markers could not send during this benchmark: {dropped}",
        "",
    ]
    return "\n".join(lines), {
        "driver_c_us": us[C_STEP, "cpu"],
        "driver_py_us": us[PY_STEP, "cpu"],
        "driver_c_frames": frames[C_STEP],
        "driver_py_frames": frames[PY_STEP],
        "driver_floor_us": _floor(cpu),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401  (its types fill the interpreter's caches, as in training)

    from bench.common import headline, monitored_run
    from bench.results import write_section

    with monitored_run("driver") as run:
        times, frames = measure(run, args.n, args.repeats)
    text, figures = section(times, frames, args.n, args.repeats, run.dropped)
    print(text)
    if not args.no_write:
        write_section(text)
    headline("driver_step", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
