"""What CurveZMQ (the secret of a job's own sidecar) costs the training process.

    python bench/curve_cost.py [--messages N] [--no-write]

A real ``sidecar serve`` process, with and without ``SIDECAR_SECRET``, receives N
messages of 1023 records (a full flush of the markers) from a ``markers.transport.Sender`` in
this process, paced like a fast loop (a 2 ms sleep between messages). Measured: this
process's CPU time (every thread: the ZeroMQ I/O thread encrypts) per message and per
record, median of interleaved repeats; the sleep's own CPU is in both and cancels in the
difference. Writes ``## CURVE cost`` into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import machine_line, write_section  # noqa: E402
from markers import secret as shared_secret  # noqa: E402
from markers import wire  # noqa: E402
from markers.transport import Sender  # noqa: E402
from tests.support.frames import records  # noqa: E402

RECORDS = wire.FLUSH_SLOTS - 1  # a full flush: its context slot and the records after it


def cpu_s() -> float:
    """User and system CPU time of this process (all threads), seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(folder: Path, secret: str | None, messages: int) -> float:
    """CPU seconds of this process per message sent to a sidecar (with ``secret``: CURVE)."""
    endpoint = f"ipc://{folder}/{'curve' if secret else 'plain'}.sock"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment.pop(shared_secret.ENV, None)
    if secret:
        environment[shared_secret.ENV] = secret
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--quiet",
            "--root",
            str(folder),
            "--endpoint",
            endpoint,
        ],
        env=environment,
    )
    sender = Sender(endpoint, os.urandom(16), 0, secret)
    try:
        hello = {"type": wire.HELLO, "out_dir": "bench", "cwd": "/", "num_measurements": 10}
        reply = sender.request(hello, 30.0, connect_timeout_s=30.0)
        assert reply and reply["ok"], reply
        body = records(RECORDS)
        started = cpu_s()
        for _ in range(messages):
            sender.send_records(body, RECORDS)
            time.sleep(0.002)  # ~0.5 M records/s: well within the sidecar's pace
        assert sender.request({"type": wire.STATUS}, 60.0), "the sidecar did not answer"
        assert sender.dropped == 0
        return (cpu_s() - started) / messages
    finally:
        sender.close()
        sidecar.terminate()
        sidecar.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    plain, curve = [], []
    with tempfile.TemporaryDirectory(prefix="curve-", dir="/tmp") as tmp:
        for _ in range(args.repeats):
            plain.append(measure(Path(tmp), None, args.messages))
            curve.append(measure(Path(tmp), shared_secret.new(), args.messages))
    plain_us, curve_us = statistics.median(plain) * 1e6, statistics.median(curve) * 1e6
    extra_ns = (curve_us - plain_us) * 1000 / RECORDS
    text = (
        "## CURVE cost\n\n" + machine_line("python bench/curve_cost.py") + "\n\n"
        f"CPU time of the training process (all threads) per message of {RECORDS} records, sent "
        "to a real sidecar, with and without the job's secret (CurveZMQ); medians of "
        f"{args.repeats} interleaved runs of {args.messages} messages.\n\n"
        "| transport | CPU per message (µs) | extra per record (ns) |\n|---|---|---|\n"
        f"| plain | {plain_us:.1f} | — |\n"
        f"| CURVE | {curve_us:.1f} | {extra_ns:.0f} |\n\n"
        "The encryption runs in ZeroMQ's I/O thread, not in the loop's `send`: compare the "
        "extra per record with a marker's own cost in Marker overhead.\n"
    )
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
