"""The exports' cost to the sidecar: its ingest rate and RSS with every exporter on
(TensorBoard and MLflow, into a local SQLite tracking store) beside none.

    python bench/exports_cost.py [--records 2000000] [--repeats 3]

The ingest benchmark's run (``bench/ingest.py``: a real ``sidecar serve``, one producer
sending well-formed RECORDS messages with blocking sends, the rate from go to the last
record counted) with ``--export tensorboard,mlflow`` or without; medians over
``--repeats`` runs, alternating. On ingest the exports add one mask per read (the step
timeline) and keep 16 bytes per training iteration; the points are made at writes, on
the exports thread. The training loop's cost does not change: the markers send the same
records (their only change is a few hello fields at ``start_run``).

Writes ``## Exports``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import headline, load_line  # noqa: E402
from bench.ingest import ingest_once  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402

MODES = {"none": (), "tensorboard,mlflow": ("--export", "tensorboard,mlflow")}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write its section of bench/RESULTS.md."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-exports-") as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        for _ in range(args.repeats):
            for mode, more in MODES.items():
                runs[mode].append(ingest_once(1, args.records, sample_rss=True, more=more))
    rows = []
    figures = {}
    for mode, results in runs.items():
        rate = statistics.median(r["rate"] for r in results)
        peak = statistics.median(r["peak_mb"] for r in results)
        lost = sum(r["lost"] for r in results)
        figures[mode] = {"rate": rate, "peak_mb": peak}
        rows.append(f"| {mode} | {rate / 1e6:.2f} M/s | {peak:.0f} MB | {lost} |")
    ratio = figures["tensorboard,mlflow"]["rate"] / figures["none"]["rate"]
    text = "\n".join(
        [
            "## Exports",
            "",
            f"{args.repeats} runs of each, alternating: one producer, the sidecar's ingest "
            "rate and peak RSS "
            "(medians) with every exporter on (`--export tensorboard,mlflow`, MLflow into a "
            "local SQLite store) and with none.",
            "",
            "| exports | ingest rate | sidecar peak RSS | lost |",
            "|---|---|---|---|",
            *rows,
            "",
            f"Rate with exports / without: {ratio:.2f}. The exporters' libraries are "
            "imported on the exports thread when a run first asks for them, while its "
            "records arrive (MLflow takes seconds to import on a loaded machine), so in "
            "these short runs that import overlaps the measured ingest; the RSS difference "
            "is mostly those libraries. The training loop's cost is unchanged: the markers "
            "send the same records; the exports are made by the sidecar, on its own thread, "
            "at writes.",
            "",
            machine_line(f"python bench/exports_cost.py --records {args.records}"),
            load_line(),
            "",
        ]
    )
    write_section(text)
    headline("exports", {m: f["rate"] for m, f in figures.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
