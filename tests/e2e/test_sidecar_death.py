"""The sidecar dies mid-run (docs/contract.md, Faults and bad input): the training loop keeps its
speed (no block, no exception), the markers' memory stays bounded while records are
dropped and counted, and a new sidecar on the same endpoint takes the run over; the
summary reports the gap.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from markers.transport import SEND_QUEUE_BYTES, SNDHWM
from tests.support.helpers import progress, run_json, split_dir, start_job, status, wait_for

# The markers queue at most SNDHWM messages of at most FLUSH_SLOTS slots of 24 bytes
# (SEND_QUEUE_BYTES, 4 MiB) while no sidecar takes them, plus ZeroMQ's own overhead.
MEMORY_BOUND = SEND_QUEUE_BYTES + 28 * 1024 * 1024
# An iteration or a checkpoint blocked on the absent sidecar would take its request
# timeout (5 s); a scheduling hiccup on a busy machine stays far below this.
SPEED_BOUND_S = 1.0
# About a second per epoch; the job's progress file is written every 200 iterations, and a
# message of FLUSH_SLOTS slots holds about 170 iterations of this job.
ITERS_PER_EPOCH = 1000


def test_sigkill_of_the_sidecar_then_a_new_one_takes_over(serve, short_tmp: Path) -> None:
    first = serve()
    out = short_tmp / "root" / "survivor"
    stop, burst, path = short_tmp / "stop", short_tmp / "burst", short_tmp / "p.json"
    job = start_job(
        first.endpoint,
        short_tmp,
        "--out-dir",
        str(out),
        "--iters",
        str(ITERS_PER_EPOCH),
        "--stop-file",
        str(stop),
        "--burst-file",
        str(burst),
        "--progress",
        str(path),
        "--warmup",
        "2",
        "--cap",
        "2000",
    )
    wait_for(lambda: progress(path).get("checkpoints_ok", 0) >= 2, 60, "two checkpoints")
    # Some records must reach the first sidecar after its last checkpoint (they are lost
    # with it): the kill falls in the middle of an epoch, whose first iterations filled
    # more than one message (a checkpoint comes only at the epoch's end).
    wait_for(
        lambda: 400 <= progress(path)["iterations"] % ITERS_PER_EPOCH <= 600,
        60,
        "the middle of an epoch",
    )
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(10)
    before = progress(path)
    # No sidecar: a burst of fast iterations overflows the markers' queue.
    burst.touch()
    absent = wait_for(
        lambda: (
            (p := progress(path)).get("iterations", 0) > before["iterations"] + 100_000
            and p["dropped"] > 0
            and p
        ),
        120,
        "a burst without sidecar",
    )
    burst.unlink()
    assert job.poll() is None  # no exception reached the loop
    assert absent["rss"] - before["rss"] < MEMORY_BOUND
    assert absent["epochs"] > before["epochs"]  # epochs (and their checkpoints) went on
    assert absent["checkpoints_ok"] == before["checkpoints_ok"]
    assert absent["max_checkpoint_s"] < SPEED_BOUND_S
    assert absent["max_step_s"] < SPEED_BOUND_S
    print(
        f"without sidecar: {absent['iterations'] - before['iterations']} iterations, "
        f"{absent['dropped']} records dropped, RSS +{(absent['rss'] - before['rss']) >> 10} "
        f"KiB (queue bound: {SNDHWM} messages), slowest step {absent['max_step_s']:.4f} s, "
        f"slowest checkpoint {absent['max_checkpoint_s']:.4f} s"
    )

    second = serve()  # same endpoint; the markers reconnect and re-announce the run
    # The markers' whole queue (SNDHWM messages) reaches the new sidecar at once; a status
    # request waits behind it, so one that times out is simply asked again.
    view = wait_for(
        lambda: (
            (v := status(second.endpoint, 5.0)) and v["runs"] and v["runs"][0]["records"] > 0 and v
        ),
        60,
        "the new sidecar to take the run over",
    )
    assert view["runs"][0]["pid"] == job.pid
    wait_for(
        lambda: progress(path)["checkpoints_ok"] > absent["checkpoints_ok"],
        30,
        "a checkpoint answered by the new sidecar",
    )
    stop.touch()
    assert job.wait(60) == 0
    done = progress(path)
    document = run_json(out)
    assert document["status"] == "completed"
    assert document["splits"]["0"]["sessions"] == 1  # the same process all along
    summary = (split_dir(out) / "summary.log").read_text()
    assert len(re.findall(r"^Sidecar gap: from \d+\.\d+ s to \d+\.\d+ s", summary, re.M)) == 1
    records = re.search(r"Records: received (\d+), dropped (\d+) .* lost (\d+)", summary)
    assert records is not None
    received, dropped, lost = map(int, records.groups())
    assert received > lost
    assert dropped == done["dropped"] > 0
    assert lost > 0  # sent to the killed sidecar after its last checkpoint
    effective = float(re.search(r"Training time: effective (\d+\.\d+) s", summary)[1])
    assert abs(effective - done["elapsed_s"]) < 1.0  # one process: no time lost nor doubled
    print(summary[summary.index("Resources") :])
    stored = (split_dir(out) / "logs" / "computational.tsv").read_text().splitlines()
    assert len(stored) > 100
