"""A configuration the markers cannot use never stops the training script (docs/contract.md, Faults
and bad input "bad SIDECAR_ENDPOINT, unusable runtime folder"): one warning, an unmonitored run,
training goes on. And a plain ``python train.py`` killed by SIGKILL: its private sidecar writes the
files with a cause that says what happened, and leaves no empty ``job-*`` socket folder behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import JOB, env, job_args, progress, run_json, wait_for

TRAIN = """
import markers
run = markers.start_run(out_dir="maps")
with run:
    with run.epoch():
        for _ in run.train_batches(range(20)):
            with run.phase("forward"):
                pass
print(type(run).__name__, "trained")
"""


def _train(cwd: Path, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", TRAIN],
        cwd=cwd,
        env=env(**variables),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _runtime_file(tmp: Path) -> dict[str, str]:
    (tmp / "file").write_text("")
    return {"XDG_RUNTIME_DIR": str(tmp / "file")}


def _runtime_of_another_user(tmp: Path) -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("making a folder of another uid needs root")
    (tmp / "rt" / "sidecar").mkdir(parents=True)
    os.chown(tmp / "rt" / "sidecar", 65534, 65534)
    return {"XDG_RUNTIME_DIR": str(tmp / "rt")}


def _runtime_symlink(tmp: Path) -> dict[str, str]:
    (tmp / "rt").mkdir()
    (tmp / "rt" / "sidecar").symlink_to("/usr")
    return {"XDG_RUNTIME_DIR": str(tmp / "rt")}


@pytest.mark.parametrize(
    ("configure", "says"),
    [
        (lambda tmp: {"SIDECAR_ENDPOINT": "udp://127.0.0.1:9"}, "unknown endpoint scheme 'udp'"),
        (lambda tmp: {"SIDECAR_ENDPOINT": "127.0.0.1:5555"}, "no endpoint scheme"),
        (
            lambda tmp: {"SIDECAR_ENDPOINT": "tcp://127.0.0.1:1", "SIDECAR_SECRET": "not hex"},
            "SIDECAR_SECRET must be 64 hex digits",
        ),
        (_runtime_file, "Not a directory"),
        (_runtime_of_another_user, "is not a folder owned by uid"),
        (_runtime_symlink, "is not a folder owned by uid"),
    ],
    ids=["udp", "host-port", "bad-secret", "runtime-file", "other-uid", "symlink"],
)
def test_an_unusable_configuration_gives_one_warning_and_training_goes_on(
    short_tmp: Path, configure, says: str
) -> None:
    result = _train(short_tmp, **configure(short_tmp))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["NullRun", "trained"]
    assert result.stderr.count("RuntimeWarning") == 1, result.stderr
    assert says in result.stderr and "training goes on" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (short_tmp / "maps").exists()


def test_a_plain_job_killed_by_sigkill_is_written_with_its_cause_and_leaves_no_folder(
    short_tmp: Path,
) -> None:
    out = short_tmp / "maps"
    job = subprocess.Popen(
        [
            sys.executable,
            str(JOB),
            *job_args(out_dir=out, iters=100000, epochs=1, progress=short_tmp / "p.json"),
        ],
        cwd=short_tmp,
        env=env(XDG_RUNTIME_DIR=str(short_tmp)),
        stdin=subprocess.DEVNULL,
    )
    wait_for(
        lambda: progress(short_tmp / "p.json").get("iterations", 0) >= 200, 60, "the job to train"
    )
    assert len(list((short_tmp / "sidecar").glob("job-*"))) == 1  # its private socket
    job.kill()
    job.wait()
    document = wait_for(
        lambda: run_json(out).get("status") == "incomplete" and run_json(out),
        10,
        "the run written as incomplete",
    )
    assert document["cause"].startswith(
        f"process {job.pid} ended without finish() (killed, e.g. by SIGKILL"
    )
    wait_for(
        lambda: not list((short_tmp / "sidecar").glob("job-*")),
        10,
        "the private socket folder to be removed",
    )
