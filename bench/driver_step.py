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
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
perf_counter = time.perf_counter

BARE = "bare loop over the loader"
C_STEP = "driver, C step"
C_AGAIN = "driver, C step again (A/A)"
PY_STEP = "driver, Python step"


def driven(run: Any, kind: type) -> Callable[[list[Any]], float]:
    """A timed loop of ``run``'s driver built on ``kind``: seconds for the whole loader."""
    import markers.run as run_module

    def loop(loader: list[Any]) -> float:
        run_module.Driver = kind  # type: ignore[attr-defined]
        start = perf_counter()
        for _ in run.train_batches(loader):
            pass
        return perf_counter() - start

    return loop


def bare(loader: list[Any]) -> float:
    start = perf_counter()
    for _ in loader:
        pass
    return perf_counter() - start


def frames_per_step(loop: Callable[[list[Any]], float], loader: list[Any]) -> float:
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


def measure(run: Any, n: int, repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """ns per step of each variant in each repeat, and Python frames per step."""
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
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, loop in variants.items():
            times[name].append(loop(loader) / n * 1e9)
    return times, frames


def section(
    times: dict[str, list[float]], frames: dict[str, float], n: int, repeats: int, dropped: int
) -> tuple[str, dict[str, float]]:
    """The ``## Loop driver step`` section and the headline figures."""
    from bench.common import load_line, spread
    from bench.results import machine_line

    base = times[BARE]
    net = {
        name: [t - b for t, b in zip(values, base, strict=True)] for name, values in times.items()
    }
    c_us = statistics.median(net[C_STEP]) / 1e3
    py_us = statistics.median(net[PY_STEP]) / 1e3
    floor_us = (
        statistics.median(abs(a - b) for a, b in zip(net[C_STEP], net[C_AGAIN], strict=True)) / 1e3
    )
    ratios = [p / c for p, c in zip(net[PY_STEP], net[C_STEP], strict=True) if c > 0]
    lines = [
        "## Loop driver step",
        "",
        machine_line("python bench/driver_step.py") + f" {load_line()} at the end. "
        f"torch imported; `for batch in run.train_batches(loader): pass` over {n} ready "
        f"`(inputs, labels)` tensor pairs per block, {repeats} interleaved repeats; per "
        "step: median (min–max); 'net' subtracts the bare loop's time in the same repeat; "
        "a real sidecar listening; frames: Python frames entered per step "
        "(`sys.setprofile`).",
        "",
        "| variant | per step (ns) | net (µs) | Python frames per step |",
        "|---|---:|---:|---:|",
    ]
    for name, values in times.items():
        net_cell = "" if name == BARE else f"{statistics.median(net[name]) / 1e3:.2f}"
        lines.append(f"| {name} | {spread(values)} | {net_cell} | {frames[name]:.2f} |")
    lines += [
        "",
        f"- C step: **{c_us:.2f} µs** and {frames[C_STEP]:.2f} frames a step; Python step: "
        f"{py_us:.2f} µs and {frames[PY_STEP]:.2f} frames (Python / C per repeat: median "
        f"{statistics.median(ratios):.2f}×); noise floor (|A − A'|, median): "
        f"{floor_us:.2f} µs",
        "- the C step's remaining frames are its flushes' (one message every 1024 slots); "
        "the Python step's: the step, the batch size reader (two), the step end, the "
        "loop record and next context (three), the data loading slot",
        f"- records the markers could not send during this benchmark: {dropped}",
        "",
    ]
    return "\n".join(lines), {
        "driver_c_us": c_us,
        "driver_py_us": py_us,
        "driver_c_frames": frames[C_STEP],
        "driver_py_frames": frames[PY_STEP],
        "driver_floor_us": floor_us,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401  (its types fill the interpreter's caches, as in training)

    import markers
    from bench.common import headline, sidecar
    from bench.results import write_section

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, sidecar(Path(tmp)) as (endpoint, _):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = markers.start_run(out_dir="driver", warmup_iterations=0, endpoint=endpoint)
        times, frames = measure(run, args.n, args.repeats)
        run.finish()
    text, figures = section(times, frames, args.n, args.repeats, run.dropped)
    print(text)
    if not args.no_write:
        write_section(text)
    headline("driver_step", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
