"""What a marked step's parts cost with the CPU caches cold, as inside a real training step.

    python bench/cold_cache.py [--n 3000] [--repeats 7] [--evict-mib 4] [--no-write]

Between two calls of the markers a training step runs hundreds of microseconds of torch,
which evicts the lines the markers' code and objects were in: a part that costs 1 µs in a
warm loop (bench/driver_step.py, bench/markers_overhead.py) costs several in the step.
This is why the end-to-end slowdown (bench/end_to_end.py) is many times the warm costs.

Each variant times one part per step on ``perf_counter_ns``, warm (the part alone in a
loop) and cold (after summing a NumPy array of ``--evict-mib`` MiB, the L2's size here,
between two parts; not timed), a real sidecar listening, torch imported. Side by side in
one process, interleaved, medians of repeats; 'net' subtracts the empty part's median in
the same repeat:

* empty: the two clock reads alone;
* ``next`` of a bare list iterator, and of ``run.train_batches`` over ``(inputs,
  labels)`` tensor pairs (the batch size read from their ``shape``) and over pairs of
  plain objects with a ``shape`` tuple (the driver without torch's getter);
* the two tensors' ``shape`` read alone;
* three ``with`` blocks of a no-op C context manager (``threading.Lock``) looked up by
  name, and three ``with run.phase(name)``.

Writes ``## Cold-cache cost``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
perf_counter_ns = time.perf_counter_ns
PHASES = ("forward", "backward", "optimization")
EMPTY = "empty (two clock reads)"

Part = Callable[[Iterator[Any]], None]  # one timed part of a step, given the step's iterator


class ShapedBatch:
    """A batch element with a first dimension and no torch behind it."""

    shape = (64, 784)


def per_step_ns(part: Part, loop: Callable[[], Iterator[Any]], n: int, evict: Any) -> float:
    """The median ns of ``part`` over ``n`` steps of ``loop()``; with ``evict`` (an array),
    its sum runs before each step, untimed."""
    times = []
    steps = loop()
    for _ in range(n):
        if evict is not None:
            evict.sum()
        start = perf_counter_ns()
        part(steps)
        times.append(perf_counter_ns() - start)
    return statistics.median(times)


def variants(run: Any, n: int) -> dict[str, tuple[Part, Callable[[], Iterator[Any]]]]:
    """Each variant's part and the iterator its steps draw from."""
    import torch

    tensors = (torch.randn(64, 784), torch.randint(0, 10, (64,)))
    objects = (ShapedBatch(), ShapedBatch())
    locks = {name: threading.Lock() for name in PHASES}

    def nothing() -> Iterator[Any]:
        return iter(())

    def phases(lookup: Callable[[str], Any]) -> Part:
        def part(_: Iterator[Any]) -> None:
            with lookup("forward"):
                pass
            with lookup("backward"):
                pass
            with lookup("optimization"):
                pass

        return part

    def tensor_shapes(_: Iterator[Any]) -> None:
        tensors[0].shape, tensors[1].shape  # the read is what is timed

    # n + 1 batches: the loop's iterator never ends inside a block
    return {
        EMPTY: (lambda _: None, nothing),
        "`next`, bare list": (next, lambda: iter([tensors] * (n + 1))),
        "`next`, train_batches over tensor pairs": (
            next,
            lambda: iter(run.train_batches([tensors] * (n + 1))),
        ),
        "`next`, train_batches over shaped objects": (
            next,
            lambda: iter(run.train_batches([objects] * (n + 1))),
        ),
        "two tensors' `shape`": (tensor_shapes, nothing),
        "three `with lock`": (phases(locks.__getitem__), nothing),
        "three `with run.phase(name)`": (phases(run.phase), nothing),
    }


def measure(run: Any, n: int, repeats: int, evict_mib: float) -> dict[str, dict[str, list[float]]]:
    """ns per step of each variant, warm and cold, per repeat."""
    import numpy as np

    evict = np.zeros(int(evict_mib * 2**20) // 8)
    parts = variants(run, n)
    times: dict[str, dict[str, list[float]]] = {"warm": {}, "cold": {}}
    for part, loop in parts.values():  # warm up: specialization, first sends
        per_step_ns(part, loop, n // 10, evict)
    for _ in range(repeats):
        for cache, array in (("warm", None), ("cold", evict)):
            for name, (part, loop) in parts.items():
                times[cache].setdefault(name, []).append(per_step_ns(part, loop, n, array))
    return times


def ours_us(net: dict[str, float]) -> tuple[float, float]:
    """The markers' own share of a step from net µs by variant: the driver's ``next``
    over a bare list's, and the three phases (``with`` statements an unmarked step does
    not have; the no-op ones show how much of it is the statement's own)."""
    driver = net["`next`, train_batches over tensor pairs"] - net["`next`, bare list"]
    return driver, net["three `with run.phase(name)`"]


def section(
    times: dict[str, dict[str, list[float]]], n: int, repeats: int, evict_mib: float
) -> tuple[str, dict[str, float]]:
    """The ``## Cold-cache cost`` section and the headline figures (µs, net)."""
    from bench.common import load_line
    from bench.results import machine_line

    net = {
        cache: {
            name: statistics.median(t - e for t, e in zip(values, by_name[EMPTY], strict=True))
            / 1e3
            for name, values in by_name.items()
        }
        for cache, by_name in times.items()
    }
    lines = [
        "## Cold-cache cost",
        "",
        machine_line("python bench/cold_cache.py") + f" {load_line()} at the end. "
        f"torch imported, a real sidecar listening; each part timed once a step, {n} steps "
        f"per block, {repeats} interleaved repeats; cold: a {evict_mib:g} MiB NumPy array "
        "summed before each step (untimed), as a training step's torch work evicts the "
        "caches between two calls of the markers; µs per step, net of the empty part's "
        "median in the same repeat (median over repeats).",
        "",
        "| part | warm (µs) | cold (µs) | cold / warm |",
        "|---|---:|---:|---:|",
    ]
    for name in times["warm"]:
        if name == EMPTY:
            continue
        warm, cold = net["warm"][name], net["cold"][name]
        ratio = f"{cold / warm:.1f}×" if warm > 0.05 else ""
        lines.append(f"| {name} | {warm:.2f} | {cold:.2f} | {ratio} |")
    (driver, phases), (warm_driver, warm_phases) = ours_us(net["cold"]), ours_us(net["warm"])
    lines += [
        "",
        f"- a marked step's markers, cold: the driver's `next` **{driver:.2f} µs** over a "
        f"bare list's, the three phases **{phases:.2f} µs** (three no-op `with` blocks: "
        f"{net['cold']['three `with lock`']:.2f} µs): "
        f"{driver + phases:.2f} µs a step, what bench/end_to_end.py's fine comparison "
        f"sees, against {warm_driver + warm_phases:.2f} µs warm",
        "",
    ]
    return "\n".join(lines), {
        "cold_driver_us": driver,
        "cold_phases_us": phases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3000, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--evict-mib", type=float, default=4.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from bench.common import headline, monitored_run
    from bench.results import write_section

    with monitored_run("cold", train_batch_size=64) as run:
        times = measure(run, args.n, args.repeats, args.evict_mib)
    text, figures = section(times, args.n, args.repeats, args.evict_mib)
    print(text)
    if not args.no_write:
        write_section(text)
    headline("cold_cache", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
