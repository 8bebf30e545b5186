"""A run whose final write never fits (a full disk) when the daemon stops: the stop names
the run and why, and run.json, which still fits, says how the run ended, never
``running`` (docs/contract.md, Faults and bad input). The full disk is
``tests.support.disk_quota``'s, handed to the sidecar by the test launcher.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.disk_quota import DiskQuota
from tests.support.helpers import Sidecar, job_args, progress, run_json, start_job, wait_for

SIZE = 1024 * 1024
ROOM = 8000  # bytes left: run.json (a few KB: goodput, nodes) fits, the tables do not


def _writing(root: Path) -> bool:
    """Whether a write is under way under ``root`` (``write_atomic``'s temporary file)."""
    return any(name.endswith(".tmp") for _, _, names in os.walk(root) for name in names)


def fill_leaving(root: Path, room_bytes: int) -> None:
    """Size ``root/filler`` so that ``room_bytes`` are left, measured twice alike with no
    write under way: the job checkpoints all along, and a checkpoint landing between a
    measure and the fill would leave less room than meant (then run.json no longer fits)."""
    quota, filler = DiskQuota(root, SIZE), root / "filler"
    filler.touch()
    deadline = time.monotonic() + 30
    seen: list[int] = []
    while time.monotonic() < deadline:
        time.sleep(0.01)  # the sidecar shares the two cores with this poll
        room = None if _writing(root) else quota.room(root)
        if room is None or _writing(root):
            seen.clear()
            continue
        seen.append(room)
        if seen[-2:] == [room_bytes, room_bytes]:
            return
        if room != room_bytes:
            os.truncate(filler, filler.stat().st_size + room - room_bytes)
            seen.clear()
    raise AssertionError(f"{root} never kept {room_bytes} bytes free: {seen}")


def test_a_run_never_written_is_named_and_not_left_running(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    root = short_tmp / "disk"
    root.mkdir()
    sidecar = serve(root=root, seams=["--disk-quota", f"{root}:{SIZE}"])
    stop, path = short_tmp / "stop", short_tmp / "p.json"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        *job_args(out_dir="run", iters=30, cap=20, stop_file=stop, progress=path),
    )
    folder = root / "run"
    wait_for(
        lambda: (
            run_json(folder).get("status") == "running"
            and progress(path).get("checkpoints_ok", 0) >= 1
        ),
        60,
        "a first checkpoint",
    )
    fill_leaving(root, ROOM)
    stop.touch()
    assert job.wait(60) == 0
    run_id = sidecar.status()["runs"][0]["run_id"]
    wait_for(lambda: sidecar.status()["runs"][0]["status"] == "completed", 30, "the finish")
    sidecar.process.send_signal(signal.SIGTERM)
    sidecar.process.wait(30)
    log = sidecar.log.read_text()
    named = [line for line in log.splitlines() if "was not written" in line]
    assert len(named) == 1 and run_id in named[0] and str(folder) in named[0], log
    assert "No space left on device" in named[0]
    meta = json.loads((folder / "run.json").read_text())
    assert meta["status"] == "completed", (meta, log)
    assert not any(name.endswith(".tmp") for name in os.listdir(folder))
