"""Time to write a split's files (the checkpoint path: tables, summary, run.json, resume
state) against the cap ``num_measurements``, every stored iteration filled.

    python bench/write_cap.py [--caps 100,1000,10000,100000] [--no-write]

The split is built in memory through the real aggregator from synthetic records (one
training iteration = data loading, forward, backward, optimization, loop: 5 stored rows),
and ``sinks.writer.write_split`` writes it with its resume state into a temporary folder,
as a run's checkpoints do. The writers format each stored row once and keep its text
(``sidecar/sinks/rowtext.py``), so a write costs what is new since the last one plus
joining and writing the kept text. Per cap, one split, in this order (pandas imported
beforehand):

* *first write*: the split filled up to ``step`` iterations short of the cap, written for
  the first time: every row formatted (also the first checkpoint after a resume, whose
  loaded rows have no text yet);
* *cap fills*: ``step`` more iterations (the cap is full), written: their rows formatted;
* *past the cap*: ``step`` more iterations (streaming figures only, nothing stored);
* *repeated*: best of 3 more writes, nothing new.

``step`` is 1,000 iterations (half the cap below 2,000). Writes ``## Write time vs cap``.
Target: a checkpoint with num_measurements = 10⁵ written in under 1 s: the verdict takes
the slowest of the cap-fills, past-the-cap and repeated writes (a run's checkpoints);
the first write is reported beside it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import headline  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402
from bench.synthetic import training_records  # noqa: E402
from sidecar.model.aggregator import Settings  # noqa: E402
from sidecar.model.derived import derive  # noqa: E402
from sidecar.model.split import RecordCounts, Split  # noqa: E402
from sidecar.resources.monitor import ResourceFigures  # noqa: E402
from sidecar.sinks import writer  # noqa: E402

TARGET_S = 1.0
STEP = 1_000  # iterations between the measured checkpoints
FIGURES = ResourceFigures([], None, "benchmark", {}, [], [], 0)
COUNTS = RecordCounts(0, 0, 0, 0, None)


@dataclass
class CapTimes:
    """Seconds of the writes of one cap (see the module docstring)."""

    cap: int
    rows: int  # rows in phases.tsv
    first_s: float
    fills_s: float
    past_s: float
    repeated_s: float

    @property
    def checkpoint_s(self) -> float:
        """The slowest write of a run whose earlier checkpoints were written."""
        return max(self.fills_s, self.past_s, self.repeated_s)


def add_iterations(split: Split, first: int, count: int) -> None:
    """Iterations ``first`` .. ``first + count - 1`` into rank 0 (records as received)."""
    agg = split.rank(0)
    for values in training_records(count, first=first):
        agg.add_records(values)


def timed_write(split: Split) -> float:
    """Seconds of one full write of ``split`` with its resume state."""
    start = time.perf_counter()
    writer.write_split(split, derive(split), FIGURES, COUNTS, with_state=True)
    return time.perf_counter() - start


def measure_cap(folder: Path, cap: int) -> CapTimes:
    """The writes of one split of cap ``cap`` (see the module docstring)."""
    step = min(STEP, cap // 2)
    split = Split(folder, 0, Settings(num_measurements=cap), {"start_unix": time.time()})
    split.rank(0).begin_session(time.time(), 0)
    add_iterations(split, 0, cap - step)
    first_s = timed_write(split)
    add_iterations(split, cap - step, step)
    fills_s = timed_write(split)
    add_iterations(split, cap, step)
    past_s = timed_write(split)
    repeated_s = min(timed_write(split) for _ in range(3))
    rows = sum(len(s.rows) for s in split.rank(0).series.values())
    return CapTimes(cap, rows, first_s, fills_s, past_s, repeated_s)


def measure(caps: list[int]) -> list[CapTimes]:
    """The writes of each cap."""
    writer.load_modules()  # pandas, imported once before any timing
    with tempfile.TemporaryDirectory(prefix="bench-write-") as tmp:
        return [measure_cap(Path(tmp) / str(cap), cap) for cap in caps]


def section(results: list[CapTimes]) -> str:
    """The ``## Write time vs cap`` section."""
    lines = [
        "## Write time vs cap",
        "",
        machine_line("python bench/write_cap.py") + " Every file of a split with its "
        "resume state (a checkpoint), every stored iteration filled (5 phases each). "
        f"First write: the split {STEP:,} iterations short of the cap (half the cap "
        "below 2,000) written for the first time, every row formatted (as after a "
        f"resume); cap fills: {STEP:,} more iterations, the cap full, written; past the "
        f"cap: {STEP:,} more (nothing stored); repeated: best of 3 more writes. Each "
        "row's text is formatted once and kept (`sidecar/sinks/rowtext.py`).",
        "",
        "| num_measurements | rows in phases.tsv | first write (s) | cap fills (s) | "
        "past the cap (s) | repeated (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.cap:,} | {r.rows:,} | {r.first_s:.3f} | {r.fills_s:.3f} | "
            f"{r.past_s:.3f} | {r.repeated_s:.3f} |"
        )
    top = results[-1]
    verdict = "met" if top.checkpoint_s < TARGET_S else "missed"
    lines += [
        "",
        f"- cap {top.cap:,}: checkpoints **{top.checkpoint_s:.2f} s** at most "
        f"(target < {TARGET_S:.0f} s: {verdict}); the first write of the split "
        f"(every row formatted) {top.first_s:.2f} s",
        "",
    ]
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
    top = results[-1]
    headline(
        "write_cap", {"seconds_top": top.checkpoint_s, "first_top": top.first_s, "cap_top": top.cap}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
