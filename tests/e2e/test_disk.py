"""Output folder not writable, disk full (docs/contract.md, Faults and bad input): a clear error in
the log and in ``sidecar status``, nothing partial on disk, data kept and written at the
next chance.

The full disk is real where the machine lets us mount a small tmpfs; everywhere (CI
without privileges too) it is also emulated by ``tests.support.disk_quota``, handed by
the test launcher to the single place where the sidecar writes. The unwritable folder is
a chmod-ed one; as root (who ignores modes) it is a read-only tmpfs mount instead,
skipped when mounting is refused.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.sinks import layout
from tests.support.helpers import JOB, env, job_args, progress, split_dir, start_job, wait_for

SIZE = 1024 * 1024  # the files of the test's run (at most 20 rows per phase) take ~100 KiB


def _mount(target: Path, options: str) -> None:
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


def _umount(target: Path) -> None:
    subprocess.run(["umount", str(target)], check=False, capture_output=True)


@dataclass
class Disk:
    """A folder to write in, the environment the sidecar needs, and how to break and heal
    it.
    """

    root: Path
    seams: list[str]  # test-launcher options for the sidecar
    heal: Callable[[], None]
    error: str


def _fill(folder: Path) -> Path:
    """Write a file until the disk is full; returns it (deleting it frees the space)."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
                os.fsync(handle.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


@pytest.fixture(params=["tmpfs", "quota", "read-only"])
def disk(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[Disk]:
    root = short_tmp / "disk"
    root.mkdir()
    if request.param == "tmpfs":
        _mount(root, f"size={SIZE},mode=0755")
        try:
            filler = _fill(root)
            yield Disk(root, [], filler.unlink, "No space left on device")
        finally:
            _umount(root)
    elif request.param == "quota":
        (root / "filler").write_bytes(b"\0" * SIZE)
        yield Disk(
            root,
            ["--disk-quota", f"{root}:{SIZE}"],
            (root / "filler").unlink,
            "No space left on device",
        )
    elif os.geteuid() == 0:
        _mount(root, f"ro,size={SIZE}")
        try:
            yield Disk(
                root,
                [],
                lambda: subprocess.run(["mount", "-o", "remount,rw", str(root)], check=True),
                "Read-only file system",
            )
        finally:
            _umount(root)
    else:
        os.chmod(root, 0o555)
        yield Disk(root, [], lambda: os.chmod(root, 0o755), "Permission denied")
        with contextlib.suppress(OSError):
            os.chmod(root, 0o755)


LOCKS = (layout.RUN_LOCK_FILE, layout.claim_file(0).split("/")[-1])  # taken at hello, not output


def _files(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.name not in ("filler", *LOCKS)
    )


def test_unwritable_output_is_reported_kept_and_written_later(
    serve, short_tmp: Path, disk: Disk
) -> None:
    sidecar = serve(root=disk.root, seams=disk.seams)
    stop, path = short_tmp / "stop", short_tmp / "p.json"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        *job_args(out_dir="run", iters=30, cap=20, stop_file=stop, progress=path),
    )
    view = wait_for(
        lambda: (v := sidecar.status())["last_error"] and v, 30, "the write error in the status"
    )
    assert disk.error in view["last_error"]
    assert disk.error in view["runs"][0]["write_error"]
    wait_for(lambda: progress(path).get("epochs", 0) >= 3, 60, "epochs despite the error")
    # Nothing partial, no temporary file left: the sidecar retries its writes, so a
    # temporary file of an attempt under way may be seen for a moment; one left behind
    # stays and fails the wait.
    wait_for(lambda: _files(disk.root) == [], 10, "no file but the filler", 0.02)
    log = sidecar.log.read_text()
    assert log.count("cannot write") == 1 and "data kept in memory" in log  # once
    before = progress(path)["epochs"]
    disk.heal()
    wait_for(
        lambda: not sidecar.status()["runs"][0]["write_error"], 30, "a write at the next checkpoint"
    )
    stop.touch()
    assert job.wait(60) == 0
    files = _files(disk.root)
    assert "run/run.json" in files and "run/training/split-0/summary.log" in files
    assert json.loads((disk.root / "run" / "run.json").read_text())["status"] == "completed"
    state = json.loads((split_dir(disk.root / "run") / "sidecar-state.json").read_text())
    epochs = state["ranks"]["0"]["series"]["1"]["rows"]["epoch"]  # rows as columns
    assert epochs[:before] == list(range(before))  # epochs from before the heal were kept
    assert sidecar.status()["last_error"]  # the last error stays visible as history


def test_a_script_whose_files_cannot_be_written_is_told_so_at_finish(short_tmp: Path) -> None:
    """The sidecar answers finish with its write error; the training script, which may
    never see the sidecar's log, gets one warning naming it, and still ends normally."""
    blocker = short_tmp / "a-file"  # an out_dir under a regular file: never writable
    blocker.write_text("")
    job = subprocess.run(
        [sys.executable, str(JOB), *job_args(out_dir=blocker / "run", epochs=1, iters=5)],
        cwd=short_tmp,
        env=env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr
    told = [
        line
        for line in job.stderr.splitlines()
        if "markers: the sidecar could not write the files" in line
    ]
    assert len(told) == 1, job.stderr
    assert "Not a directory" in told[0]
