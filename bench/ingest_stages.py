"""The sidecar's ingest in process, stage against stage: the guard of its throughput.

    python bench/ingest_stages.py [--records 2000000] [--repeats 5]

The same record stream as ``bench/ingest.py``'s producer (5-phase iterations, 1020 slots
a message), cut into reads as the receiver takes them (``READ_BYTES`` a read), goes
through two stages on this process's CPU clock, alternated in each repeat:

* **decode alone**: each message's header (``wire.decode_header``) and the records of
  the whole read (``sidecar.ingest.records.decode_bodies``): the fixed baseline;
* **the whole path**: the same decode, then the registry's records of the read
  (``Registry.records_batch``: order, counts, checks, aggregation), a run said hello to
  first, every record counted (records in = records aggregated, none lost or refused).

The ratio whole / decode is the figure to watch: both stages run on the same machine in
the same minute, so the load cancels, and a change that costs the aggregation per record
or per iteration moves it (a Python call per iteration once took it from ~0.2 to ~0.11;
the column-ordered decode and the kept heap then took it to ~0.3).
Prints its lines and a headline; ``bench/ingest.py`` puts them in its section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import headline, load_line  # noqa: E402
from bench.synthetic import RECORDS_PER_ITERATION, STEP_NS, iteration_slots  # noqa: E402
from markers import wire  # noqa: E402
from sidecar.daemon.heap import Heap, glibc  # noqa: E402
from sidecar.ingest.receiver import READ_BYTES  # noqa: E402
from sidecar.ingest.records import decode_bodies  # noqa: E402
from sidecar.ingest.streams import Registry  # noqa: E402
from tests.support.frames import Client  # noqa: E402

# 170 × (context + 5 phases) = 1020 slots, as a full flush of the markers
ITERATIONS_PER_MESSAGE = wire.FLUSH_SLOTS // (RECORDS_PER_ITERATION + 1)
RECORDS_PER_MESSAGE = ITERATIONS_PER_MESSAGE * RECORDS_PER_ITERATION
# The ratio whole / decode below which the guard says the aggregation regressed: this
# code measures 0.23-0.36 (medians ~0.3); a per-iteration Python call once cost about
# twice the whole path's per-record work, which would take it to ~0.1.
RATIO_FLOOR = 0.2


class Messages:
    """RECORDS message bodies as ``bench/ingest.py``'s producer sends them, message
    ``seq`` (from 1) continuing the iterations of the one before."""

    def __init__(self) -> None:
        self.template = np.array(
            [v for i in range(ITERATIONS_PER_MESSAGE) for v in iteration_slots(i)], dtype="<i8"
        ).reshape(-1, 3)
        self.is_context = (self.template[:, 0] & wire.TAG_MASK) == wire.TAG_CONTEXT

    def slots(self, seq: int) -> np.ndarray:
        """The slots (slots × 3 int64) of message ``seq``."""
        offset = (seq - 1) * ITERATIONS_PER_MESSAGE
        slots = self.template.copy()
        slots[self.is_context, 1] += offset  # iteration
        slots[self.is_context, 2] += offset  # warmup gate (batches before)
        slots[~self.is_context, 1:] += offset * STEP_NS
        return slots


def _reads(records: int, run_id: bytes) -> list[list[bytes]]:
    """The frames of ``records`` records (whole messages) of run ``run_id``, in reads of
    at most ``READ_BYTES`` of bodies, as the receiver takes them."""
    messages = Messages()
    reads: list[list[bytes]] = [[]]
    read_bytes = 0
    for seq in range(1, -(-records // RECORDS_PER_MESSAGE) + 1):
        body = messages.slots(seq).tobytes()
        if read_bytes + len(body) > READ_BYTES and reads[-1]:
            reads.append([])
            read_bytes = 0
        sent = (seq - 1) * RECORDS_PER_MESSAGE
        reads[-1].append(wire.pack_header(wire.KIND_RECORDS, 0, seq, sent, 0, run_id) + body)
        read_bytes += len(body)
    return reads


def _decode(read: list[bytes]) -> list[tuple[wire.Header, np.ndarray]]:
    headers = [wire.decode_header(frame) for frame in read]
    decoded = decode_bodies([frame[wire.HEADER.size :] for frame in read])
    return [(header, decoded.of(n)) for n, header in enumerate(headers)]


def _timed(work: Callable[[], int]) -> tuple[float, int]:
    start = time.process_time()
    count = work()
    return time.process_time() - start, count


def stages(records: int, repeats: int) -> dict[str, Any]:
    """Records per CPU second of decode alone and of the whole path (median of
    ``repeats``, alternated), their ratio, and the records the whole path counted."""
    Heap(glibc()).keep()  # the allocator's settings of the sidecar's process
    client = Client()
    reads = _reads(records, client.run_id)
    hello = client.hello("stages", num_measurements=100)  # as the producer's hello
    sent = sum(len(read) for read in reads) * RECORDS_PER_MESSAGE
    decode_rates, whole_rates, ratios = [], [], []
    counted = 0
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as tmp:
        for _ in range(repeats):
            registry = Registry(lambda out_dir, cwd, owner: Path(tmp) / out_dir)
            registry.hello(wire.decode_header(hello), wire.decode_control(hello), time.time())

            def decode_only() -> int:
                return sum(len(values) for read in reads for _, values in _decode(read))

            def whole(registry: Registry = registry) -> int:
                for read in reads:
                    registry.records_batch(_decode(read), time.time())
                return registry.records_received

            decode_s, decoded = _timed(decode_only)
            whole_s, counted = _timed(whole)
            if decoded != sent or counted != sent or registry.status()["lost"]:
                raise RuntimeError(
                    f"records lost in process: {sent} sent, {decoded} decoded, "
                    f"{counted} aggregated, status {registry.status()}"
                )
            decode_rates.append(sent / decode_s)
            whole_rates.append(sent / whole_s)
            ratios.append(decode_s / whole_s)
    return {
        "records": sent,
        "counted": counted,
        "repeats": repeats,
        "decode_rate": statistics.median(decode_rates),
        "whole_rate": statistics.median(whole_rates),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def lines(figures: dict[str, Any]) -> list[str]:
    """The stage table and the guard's line, for ``bench/ingest.py``'s section."""
    ratio = figures["ratio"]
    return [
        f"In process, stage against stage (`bench/ingest_stages.py`, {figures['repeats']} "
        f"repeats alternated, medians of records per CPU second; {load_line()}): "
        f"{figures['records']:,} records in reads of ≤ {READ_BYTES >> 20} MiB, "
        f"{figures['counted']:,} of them aggregated.",
        "",
        "| stage | records per CPU second |",
        "|---|---:|",
        f"| decode alone (headers, `decode_bodies`): the baseline | "
        f"{figures['decode_rate'] / 1e6:.2f} M |",
        f"| the whole path (decode, `Registry.records_batch`) | "
        f"{figures['whole_rate'] / 1e6:.2f} M |",
        f"| **whole / decode** (min–max of the repeats) | **{ratio:.2f}** "
        f"({figures['ratio_min']:.2f}–{figures['ratio_max']:.2f}) |",
        "",
        f"- guard: whole / decode ≥ {RATIO_FLOOR:.2f}: "
        f"{'held' if ratio >= RATIO_FLOOR else 'MISSED, the aggregation regressed'}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    figures = stages(args.records, args.repeats)
    print("\n".join(lines(figures)))
    headline(
        "ingest_stages",
        {k: figures[k] for k in ("decode_rate", "whole_rate", "ratio")},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
