"""The exports' cost to the sidecar in a steady state: its ingest rate and RSS with every
exporter on (TensorBoard, MLflow into a local SQLite tracking store, W&B offline)
beside none.

    python bench/exports_cost.py [--records 1000000] [--repeats 5]

Three ``sidecar serve`` processes run side by side for the whole benchmark: one with
``--export tensorboard,mlflow,wandb`` and two without (the second gives the A/A noise floor).
Each first serves a warm-up run, and the exporting one's MLflow store is polled until
that run's points are in it: the exporters' libraries are imported (MLflow takes seconds
on a loaded machine) and the store is connected before any timed run. Then runs of
``bench/ingest.py``'s kind (one producer, well-formed RECORDS messages with blocking
sends, the rate from go to the last record counted) go to the three in turn, A B A'
alternation, ``--repeats`` times, each run a new run folder (its exporters are made at
its hello, from the libraries and store already loaded); after each run the benchmark
waits until its sidecar wrote and exported it, so no run shares the machine with another
sidecar's end-of-run work. The figures are medians. On
ingest the exports add one mask per read (the step timeline) and keep 16 bytes per
training iteration; every second (``--export-every 1``) the loop hands the rows and
samples new since the last hand-over to the exports thread, which makes the points and
writes them while the run goes on, inside the clock; the end's write comes after it.
The training loop's cost does not change: the markers send the same records.

Writes ``## Exports``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import headline, load_line, sidecar  # noqa: E402
from bench.ingest import ingest_into  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402

# label -> the sidecar's export options; "none again" is the A/A noise floor
MODES = {
    "none": (),
    # live hand-overs every second (the default is 5 s): their cost falls inside the clock
    "tensorboard,mlflow,wandb": (
        "--export",
        "tensorboard,mlflow,wandb",
        "--export-every",
        "1",
    ),
    "none again": (),
}
WARMUP_RECORDS = 200_000
SETTLE_TIMEOUT_S = 300.0


def _ended(uri: str, experiment: str) -> bool:
    """Whether the MLflow store at ``uri`` holds a run of ``experiment`` that the sidecar
    ended (its last export: points, files, then the run's end)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found is not None else []
    return bool(runs and runs[0].info.status != "RUNNING")


def _settled(folder: Path, out_dir: str, uri: str | None) -> None:
    """Wait until the sidecar serving ``folder`` wrote the ended run ``out_dir`` (its
    producer stopped) and, with ``uri``, exported it: the next timed run, on whichever
    sidecar, does not share the machine with that work."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not any(folder.glob(f"**/{out_dir}/**/summary.log")) or (
        uri is not None and not _ended(uri, out_dir)
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run {out_dir} was not written and exported in time")
        time.sleep(0.2)


def measure(records: int, repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Every mode's timed runs (``ingest_into``'s figures), alternating."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory(prefix="bench-exports-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        uri = f"sqlite:///{tmp}/mlflow.db"
        os.environ["MLFLOW_TRACKING_URI"] = uri  # the sidecars' (and this process's) store
        os.environ["WANDB_MODE"] = "offline"  # W&B's own local process writes the runs
        _ended(uri, "warmup")  # the store made here first: two processes would both migrate it
        served = {}
        for i, (mode, options) in enumerate(MODES.items()):
            folder = Path(tmp) / f"sidecar-{i}"
            folder.mkdir()
            endpoint, process = stack.enter_context(sidecar(folder, "--nice", "0", *options))
            served[mode] = (folder, endpoint, process.pid, uri if options else None)
            # the warm-up: libraries imported, store connected, before any clock
            ingest_into(endpoint, process.pid, 1, WARMUP_RECORDS, out_dir="warmup")
            _settled(folder, "warmup", uri if options else None)
        for repeat in range(repeats):
            for mode, (folder, endpoint, pid, exports_to) in served.items():
                out_dir = f"run-{repeat}"
                runs[mode].append(ingest_into(endpoint, pid, 1, records, True, out_dir))
                _settled(folder, out_dir, exports_to)
    return runs


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write its section of bench/RESULTS.md."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    names = ("tensorboard", "mlflow", "wandb")
    missing = [name for name in names if not importlib.util.find_spec(name)]
    if missing:
        write_section(
            f"## Exports\n\nNot run: {', '.join(missing)} not installed "
            "(`pip install 'trainmon[tensorboard,mlflow,wandb]'`).\n"
        )
        return 0
    load_before = load_line()
    runs = measure(args.records, args.repeats)
    rows = []
    figures = {}
    for mode, results in runs.items():
        rate = statistics.median(r["rate"] for r in results)
        peak = statistics.median(r["peak_mb"] for r in results)
        lost = sum(r["lost"] for r in results)
        figures[mode] = {"rate": rate, "peak_mb": peak}
        low, high = (f(r["rate"] for r in results) / 1e6 for f in (min, max))
        spread = f"{low:.2f}–{high:.2f}"
        rows.append(f"| {mode} | {rate / 1e6:.2f} M/s | {spread} M/s | {peak:.0f} MB | {lost} |")
    ratio = figures["tensorboard,mlflow,wandb"]["rate"] / figures["none"]["rate"]
    floor = figures["none again"]["rate"] / figures["none"]["rate"]
    text = "\n".join(
        [
            "## Exports",
            "",
            f"Steady state: three sidecars side by side (exports on, none, none again), each "
            "warmed up by one run (the exporters' libraries imported, the MLflow store "
            f"connected) before the clock; then {args.repeats} runs of each of "
            f"{args.records:,} records, alternating A B A', one producer. Medians (and the "
            "range) of the sidecar's ingest rate and peak RSS with every exporter on "
            "(`--export tensorboard,mlflow,wandb`, MLflow into a local SQLite store, W&B "
            "offline) and with none.",
            "",
            "| exports | ingest rate | range | sidecar peak RSS | lost |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Rate with exports / without: **{ratio:.2f}**; the A/A pair (none again / "
            f"none), the noise floor: {floor:.2f}. The RSS difference is the exporters' "
            "libraries, loaded once per sidecar. On ingest the exports add one mask per "
            "read (the step timeline); the points are made at writes, on the exports "
            "thread. The training loop's cost is unchanged: the markers send the same "
            "records.",
            "",
            machine_line(f"python bench/exports_cost.py --records {args.records}"),
            f"{load_before} at the start; {load_line()} at the end",
            "",
        ]
    )
    print(text)
    write_section(text)
    headline(
        "exports", {m: f["rate"] for m, f in figures.items()} | {"ratio": ratio, "floor": floor}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
