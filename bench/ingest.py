"""Sidecar ingest: records per second from 1, 2, 4 and 8 producers (the ranks of one
node), none lost; the sidecar's memory over 10⁷ records from 8 producers at full rate;
the markers' own queue with no sidecar.

    python bench/ingest.py [--records 3000000] [--rss-records 10000000]
                           [--stage-records 2000000] [--stage-repeats 5] [--no-write]

A real ``sidecar serve`` process; each producer is a process of its own, one rank of one
split (as the ranks of a node share one sidecar), with a DEALER socket that says hello like
the markers, then sends well-formed RECORDS messages as the
markers' buffer makes them (``bench/synthetic.py``: 5-phase iterations, ~1024 slots a
message) with *blocking* sends, so the sidecar's pace sets the rate and nothing is dropped.
The clock runs from the moment every producer is told to go until the sidecar's status
counts every record; the status also says how many were lost (sent, not received) and
rejected. The memory run samples the sidecar's RSS at every status poll while 8
producers send 10⁷ records, and gives its peak in each quarter of them (flat: no growth
with the records taken). The queue row starts a run whose sidecar never listens and ends 10⁶ phases
as fast as it can: the training process's RSS growth is bounded by the send queue.

Then the guard of the ingest's throughput, in process (``bench/ingest_stages.py``): decode
alone against the whole path (decode, checks, aggregation) on the same reads, and their
ratio, which a regression of the aggregation moves whatever the machine's load.

Writes ``## Sidecar ingest and memory``. Targets: ≥ 2 M records/s on one core, ≥ 1 M/s
from 4 and from 8 producers, none lost; sidecar RSS ≤ 100 MB after 10⁷ records.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import ROOT as _ROOT  # noqa: E402
from bench.common import headline, load_line, sidecar  # noqa: E402
from bench.ingest_stages import (  # noqa: E402
    RATIO_FLOOR,
    RECORDS_PER_MESSAGE,
    Messages,
    stages,
)
from bench.ingest_stages import lines as stage_lines  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402
from markers import wire  # noqa: E402
from tests.support.helpers import status  # noqa: E402

RATE_TARGET_ONE = 2_000_000
RATE_TARGET_FOUR = 1_000_000
RSS_TARGET_MB = 100.0
POLL_S = 0.05
DONE_TIMEOUT_S = 600.0


def producer(endpoint: str, rank: int, records: int, out_dir: str = "ingest") -> None:
    """One producer process, rank ``rank`` of split 0 of run folder ``out_dir``: hello,
    wait for a line on stdin, send ``records`` records."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, -1)
    socket.connect(endpoint)
    run_id = uuid.uuid4().bytes
    hello = {
        "type": wire.HELLO,
        "out_dir": out_dir,
        "cwd": "/",
        "split": 0,
        "warmup_iterations": 0,
        "num_measurements": 100,
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "start_unix": time.time(),
        "start_ns": time.perf_counter_ns(),
        "reply_to": "hello",
    }
    socket.send(
        wire.encode_control(wire.pack_header(wire.KIND_CONTROL, rank, 0, 0, 0, run_id), hello)
    )
    socket.recv()
    messages = Messages()
    per_message = RECORDS_PER_MESSAGE
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    sent, seq = 0, 1
    while sent < records:
        slots = messages.slots(seq)
        header = wire.pack_header(wire.KIND_RECORDS, rank, seq, sent, 0, run_id)
        socket.send(header + slots.tobytes())
        sent += per_message
        seq += 1
    sys.stdout.write(f"sent {sent}\n")
    sys.stdout.flush()
    sys.stdin.readline()  # stay alive (the sidecar watches our pid) until told
    socket.close()


def _start_producers(
    endpoint: str, count: int, records: int, out_dir: str = "ingest"
) -> list[subprocess.Popen[str]]:
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "producer", endpoint, str(rank), str(records), out_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(_ROOT)},
        )
        for rank in range(count)
    ]
    for process in processes:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return processes


def _go(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()


def _sent(processes: list[subprocess.Popen[str]]) -> int:
    total = 0
    for process in processes:
        assert process.stdout is not None
        total += int(process.stdout.readline().split()[1])
    return total


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    for process in processes:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(30)


def ingest_once(
    count: int,
    records: int,
    sample_rss: bool = False,
    nice: int | None = None,
    more: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``count`` producers sending ``records`` in all to a fresh sidecar (``nice``: its
    ``--nice``, default its own; ``more``: other options of its command line)."""
    args = (() if nice is None else ("--nice", str(nice))) + more
    with (
        tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp,
        sidecar(Path(tmp), *args) as (endpoint, process),
    ):
        return ingest_into(endpoint, process.pid, count, records, sample_rss)


def ingest_into(
    endpoint: str,
    pid: int,
    count: int,
    records: int,
    sample_rss: bool = False,
    out_dir: str = "ingest",
) -> dict[str, Any]:
    """``count`` producers of a run in folder ``out_dir`` sending ``records`` in all to
    the running sidecar ``pid`` at ``endpoint`` (records counted from what it had
    before: one sidecar may serve several such runs in turn)."""
    side = psutil.Process(pid)
    per_message = RECORDS_PER_MESSAGE
    each = -(-(records // count) // per_message) * per_message  # whole messages
    before = status(endpoint, 30.0) or {}
    base = before.get("records", 0) + before.get("rejected", 0)
    base_lost = before.get("lost", 0)
    expected = each * count
    producers = _start_producers(endpoint, count, each, out_dir)
    idle_mb = side.memory_info().rss / 2**20
    quarters_mb = [idle_mb] * 4  # peak RSS while each quarter of the records came
    try:
        start = time.perf_counter()
        _go(producers)
        view: dict = {}
        taken = 0
        while taken < expected:
            if time.perf_counter() - start > DONE_TIMEOUT_S:
                raise RuntimeError(
                    f"the sidecar took {taken} of {expected} records in {DONE_TIMEOUT_S} s"
                )
            view = status(endpoint, 30.0) or {}
            taken = view.get("records", 0) + view.get("rejected", 0) - base
            if sample_rss:
                quarter = min(3, 4 * taken // expected)
                quarters_mb[quarter] = max(quarters_mb[quarter], side.memory_info().rss / 2**20)
            time.sleep(POLL_S)
        elapsed = time.perf_counter() - start
        sent = _sent(producers)
        after_mb = side.memory_info().rss / 2**20
    finally:
        _stop(producers)
    received = view.get("records", 0) - before.get("records", 0)
    return {
        "producers": count,
        "sent": sent,
        "received": received,
        "lost": view.get("lost", 0) - base_lost,
        "rejected": view.get("rejected_by_kind", {}),
        "dropped": view.get("dropped", 0),
        "seconds": elapsed,
        "rate": received / elapsed,
        "idle_mb": idle_mb,
        "peak_mb": max(quarters_mb),
        "quarters_mb": quarters_mb,
        "after_mb": after_mb,
    }


def markers_queue(phases: int) -> dict[str, float]:
    """In a fresh process: RSS growth of a run whose sidecar never listens."""
    code = f"""
import os, sys, time, warnings, psutil
sys.path.insert(0, {str(_ROOT)!r})
import markers
markers.CONNECT_TIMEOUT_S = 0.2
warnings.simplefilter("ignore")
run = markers.start_run(out_dir="q", endpoint="ipc://{tempfile.gettempdir()}/nobody-{os.getpid()}.sock")
me = psutil.Process()
before = me.memory_info().rss
phase = run.phase("forward")
for _ in run.train_batches(range({phases})):
    with phase:
        pass
print(before, me.memory_info().rss, run.dropped)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout.split()
    before, after, dropped = map(int, out[-3:])
    return {"growth_mb": (after - before) / 2**20, "dropped": dropped, "records": phases * 3}


def section(
    rates: list[dict[str, float]],
    memory: dict[str, float],
    queue: dict[str, float],
    stage: dict[str, Any],
) -> tuple[str, dict[str, float]]:
    """The ``## Sidecar ingest and memory`` section and the headline figures."""
    from markers.transport import SEND_QUEUE_BYTES
    from sidecar.ingest.receiver import RECEIVE_QUEUE_BYTES

    lines = [
        "## Sidecar ingest and memory",
        "",
        machine_line("python bench/ingest.py") + f" {load_line()} at the end. "
        "Producers are separate processes sending with blocking sends. The rates are "
        "measured with the sidecar at the job's priority (`--nice 0`): at its default "
        "(+10) any other work on the machine takes the CPU first; the "
        "memory run uses the default.",
        "",
        "| producers | records | seconds | records/s | lost | rejected | dropped |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rates:
        lines.append(
            f"| {r['producers']} | {r['received']:,} of {r['sent']:,} | "
            f"{r['seconds']:.2f} | **{r['rate'] / 1e6:.2f} M** | {r['lost']} | "
            f"{sum(r['rejected'].values())} {r['rejected'] or ''} | {r['dropped']} |"
        )
    one = next(r for r in rates if r["producers"] == 1)["rate"]
    four = next(r for r in rates if r["producers"] == 4)["rate"]
    eight = next(r for r in rates if r["producers"] == 8)["rate"]
    quarters = " / ".join(f"{mb:.1f}" for mb in memory["quarters_mb"])
    lines += [
        "",
        f"- one producer: {one / 1e6:.2f} M records/s (target ≥ "
        f"{RATE_TARGET_ONE / 1e6:.0f} M: {'met' if one >= RATE_TARGET_ONE else 'missed'})"
        f"; four: {four / 1e6:.2f} M/s (target ≥ {RATE_TARGET_FOUR / 1e6:.0f} M: "
        f"{'met' if four >= RATE_TARGET_FOUR else 'missed'}); eight: "
        f"{eight / 1e6:.2f} M/s (target ≥ {RATE_TARGET_FOUR / 1e6:.0f} M: "
        f"{'met' if eight >= RATE_TARGET_FOUR else 'missed'})",
        "",
        f"| sidecar memory, {memory['producers']} producers, full rate | RSS (MB) |",
        "|---|---:|",
        f"| idle, before the first record | {memory['idle_mb']:.1f} |",
        f"| peak while {memory['received'] / 1e6:.0f} M records arrived "
        f"({memory['seconds']:.1f} s, {memory['lost']} lost) | "
        f"**{memory['peak_mb']:.1f}** |",
        f"| peak in each quarter of the records (flat: no growth with them) | {quarters} |",
        f"| after them (before any write) | {memory['after_mb']:.1f} |",
        "",
        f"- target ≤ {RSS_TARGET_MB:.0f} MB: "
        f"{'met' if memory['peak_mb'] <= RSS_TARGET_MB else 'missed'}; what may wait "
        f"is bounded in bytes: {SEND_QUEUE_BYTES >> 20} MiB in each training "
        f"process's send queue, {RECEIVE_QUEUE_BYTES >> 20} MiB per connection in the "
        "sidecar's receive queue; past it the markers drop and count",
        f"- no sidecar listening, {queue['records']:,} records ended in a training "
        f"process: its RSS grew by {queue['growth_mb']:.1f} MB, {queue['dropped']:,} "
        "records dropped and counted",
        "",
        *stage_lines(stage),
        "",
    ]
    figures = {
        "rate_1": one,
        "rate_4": four,
        "rate_8": eight,
        "rss_peak_mb": memory["peak_mb"],
        "rss_idle_mb": memory["idle_mb"],
        "stage_decode": stage["decode_rate"],
        "stage_whole": stage["whole_rate"],
        "stage_ratio": stage["ratio"],
        "stage_floor": RATIO_FLOOR,
    }
    return "\n".join(lines), figures


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["producer"]:
        producer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=3_000_000)
    parser.add_argument("--rss-records", type=int, default=10_000_000)
    parser.add_argument("--stage-records", type=int, default=2_000_000)
    parser.add_argument("--stage-repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rates = [ingest_once(count, args.records, nice=0) for count in (1, 2, 4, 8)]
    memory = ingest_once(8, args.rss_records, sample_rss=True)
    queue = markers_queue(1_000_000)
    stage = stages(args.stage_records, args.stage_repeats)
    text, figures = section(rates, memory, queue, stage)
    print(text)
    if not args.no_write:
        write_section(text)
    headline("ingest", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
