"""Time to write a split's files (the checkpoint path: tables, summary, run.json, resume
state) against the cap ``num_measurements``, every stored iteration filled.

    python bench/write_cap.py [--caps 100,1000,10000,100000] [--no-write]

The split is built in memory through the real aggregator from synthetic records (one
training iteration = data loading, forward, backward, optimization, loop), then
``sinks.writer.write_split`` writes it into a temporary folder; the figure is the best of
three writes (the first one also imports pandas). Writes ``## Write time vs cap``.
Target: a checkpoint with num_measurements = 10⁵ written in under 1 s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import headline  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402
from bench.synthetic import training_records  # noqa: E402
from sidecar.model.aggregator import Settings  # noqa: E402
from sidecar.model.split import Split  # noqa: E402
from sidecar.resources.monitor import ResourceFigures  # noqa: E402
from sidecar.sinks import writer  # noqa: E402

TARGET_S = 1.0


def filled_split(folder: Path, cap: int) -> Split:
    """A split whose rank 0 stored ``cap`` training iterations (and a few epochs)."""
    split = Split(folder, 0, Settings(num_measurements=cap), {"start_unix": time.time()})
    agg = split.rank(0)
    agg.begin_session(time.time(), 0)
    for values in training_records(cap, per_message=256):
        agg.add_records(values)
    return split


def write_seconds(split: Split, repeats: int = 3) -> list[float]:
    """Seconds of each of ``repeats`` full writes of ``split`` with its resume state."""
    figures = ResourceFigures([], None, "benchmark", {}, [], [], 0)
    counts = writer.RecordCounts(0, 0, 0, 0, None)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        writer.write_split(split, figures, counts, with_state=True)
        times.append(time.perf_counter() - start)
    return times


def measure(caps: list[int]) -> list[tuple[int, int, list[float]]]:
    """(cap, rows in phases.tsv, write seconds) per cap."""
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-write-") as tmp:
        for cap in caps:
            split = filled_split(Path(tmp) / str(cap), cap)
            rows = sum(len(s.rows) for s in split.rank(0).series.values())
            out.append((cap, rows, write_seconds(split)))
    return out


def section(results: list[tuple[int, int, list[float]]]) -> str:
    """The ``## Write time vs cap`` section."""
    lines = ["## Write time vs cap", "",
             machine_line("python bench/write_cap.py") + " Every file of a split with its "
             "resume state (a checkpoint), every stored iteration filled (5 phases each); "
             "best of 3 writes (the first, which also imports pandas, in brackets).", "",
             "| num_measurements | rows in phases.tsv | write (s) | first write (s) |",
             "|---:|---:|---:|---:|"]
    for cap, rows, times in results:
        lines.append(f"| {cap:,} | {rows:,} | {min(times):.3f} | {times[0]:.3f} |")
    top = results[-1]
    verdict = "met" if min(top[2]) < TARGET_S else "missed"
    lines += ["", f"- cap {top[0]:,}: **{min(top[2]):.2f} s** (target < {TARGET_S:.0f} s: "
              f"{verdict})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", default="100,1000,10000,100000")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    results = measure([int(c) for c in args.caps.split(",")])
    text = section(results)
    print(text)
    if not args.no_write:
        write_section(text)
    headline("write_cap", {"seconds_top": min(results[-1][2]), "cap_top": results[-1][0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
