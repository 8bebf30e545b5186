"""How long the training loop waits for the sidecar at a checkpoint, and how long the
sidecar then writes, at caps of 1 000, 10 000 and 40 000 stored iterations.

A `sidecar serve` subprocess; in this process a run with one phase per iteration fills
the cap (no warmup), lets the sidecar catch up with its backlog, then: ``checkpoint()``
(the loop's wait: the sidecar takes the state and answers), the sidecar's write that
follows (read as the wait of a ``status`` request sent at once, which the sidecar answers
after the write), ``state_dict()`` (the state coming back, its size),
``load_state_dict()`` of it into a second run (in parts) and ``finish()``. Best of
``REPEATS`` rounds per cap.

Writes the section "## Checkpoint cost" of bench/RESULTS.md (replacing only that section).
Run from the repository root: ``python bench/checkpoint_cost.py``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import markers  # noqa: E402
from bench.common import sidecar  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402
from markers import wire  # noqa: E402
from markers.endpoints import connect_address  # noqa: E402
from markers.transport import Sender  # noqa: E402

CAPS = (1_000, 10_000, 40_000)
REPEATS = 2
TIMEOUT_S = 60.0


def _status_wait_s(endpoint: str) -> float:
    sender = Sender(connect_address(endpoint), bytes(16), 0)
    try:
        begin = time.perf_counter()
        assert sender.request({"type": wire.STATUS}, TIMEOUT_S, connect_timeout_s=5.0)
        return time.perf_counter() - begin
    finally:
        sender.close()


def _round(endpoint: str, root: Path, cap: int) -> dict[str, float]:
    run = markers.start_run(
        out_dir=str(root / f"cap{cap}"),
        warmup_iterations=0,
        num_measurements=cap,
        train_batch_size=8,
        endpoint=endpoint,
    )
    with run.epoch():
        for _ in run.train_batches(range(cap)):
            with run.phase("forward"):
                pass
    run._buffer.flush()
    # The empty loop outruns the sidecar's aggregation; a training step does not. Let it
    # catch up first (a status request on the run's own connection is read after its
    # records), so what follows is the checkpoint's own cost.
    begin = time.perf_counter()
    assert run._sender.request({"type": wire.STATUS}, TIMEOUT_S)
    caught_up_s = time.perf_counter() - begin
    begin = time.perf_counter()
    assert run.checkpoint(TIMEOUT_S)
    figures = {
        "checkpoint_s": time.perf_counter() - begin,
        "write_s": _status_wait_s(endpoint),
        "catch_up_s": caught_up_s,
    }
    begin = time.perf_counter()
    saved = run.state_dict(TIMEOUT_S)
    figures["state_dict_s"] = time.perf_counter() - begin
    figures["state_mb"] = len(str(saved)) / 1e6
    other = markers.start_run(out_dir=str(root / f"cap{cap}"), split=1, endpoint=endpoint)
    begin = time.perf_counter()
    assert other.load_state_dict(saved, TIMEOUT_S)
    figures["load_s"] = time.perf_counter() - begin
    other.finish()
    begin = time.perf_counter()
    run.finish()
    figures["finish_s"] = time.perf_counter() - begin
    return figures


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="ckpt-", dir="/tmp"))
    root = folder / "root"
    root.mkdir()
    with sidecar(root) as (endpoint, _):
        rows = []
        for cap in CAPS:
            rounds = [_round(endpoint, root / f"r{i}", cap) for i in range(REPEATS)]
            best = {key: min(r[key] for r in rounds) for key in rounds[0]}
            rows.append(
                f"| {cap:,} | {best['catch_up_s']:.2f} s | "
                f"{best['checkpoint_s'] * 1e3:.1f} ms | "
                f"{best['write_s']:.2f} s | {best['state_dict_s']:.2f} s | "
                f"{best['state_mb']:.1f} MB | {best['load_s']:.2f} s | "
                f"{best['finish_s']:.2f} s |"
            )
    text = "\n".join(
        [
            "## Checkpoint cost",
            "",
            machine_line("python bench/checkpoint_cost.py") + " Best of "
            f"{REPEATS} rounds; one phase per iteration, the cap filled.",
            "",
            "| cap (iterations) | sidecar catching up with the empty loop | checkpoint() in the "
            "loop | sidecar's write after it | state_dict() | state | load_state_dict() (in "
            "parts) | finish() |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "The empty loop sends records faster than the sidecar aggregates them (about "
            "4 µs per record on a 2-core VM); a checkpoint called right after such a loop "
            "first waits for that backlog (second column), a real training step leaves none.",
            "Before checkpoint() answered ahead of the write, it waited for the whole write "
            "(0.15-0.24 s at 1 000, 1.3-1.9 s at 10 000, a 5 s time-out at 40 000) and "
            "load_state_dict() failed above a cap of about 2 500.",
            "",
        ]
    )
    write_section(text)
    print(text)


if __name__ == "__main__":
    main()
