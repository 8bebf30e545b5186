"""A hello's Slurm job id is believed only when the kernel shows the process belongs to
that job: checked on real processes started with real environments, and on the cgroup
paths Slurm's cgroup plugins make; a run Slurm killed before its epilog came ends with
the job."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.daemon.slurm_jobs import (
    JobIdCheck,
    ended_by_job,
    job_of_cgroup,
    job_of_process,
    slurm_confines_in_cgroups,
)
from sidecar.ingest.peers import Peer
from sidecar.model.aggregator import Settings
from sidecar.model.split import Split

# Prints its pid, then (when given) starts a child with the environment named on the
# command line, which prints its own; waits for stdin to close.
TREE = """
import os, subprocess, sys
print(os.getpid(), flush=True)
os.environ["SLURM_JOB_ID"] = "999"  # set after start: the kernel's copy never shows it
child = None
if len(sys.argv) > 1:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    env.update(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    # the child says its pid once it runs: right after exec its environment is not set up
    child = subprocess.Popen([sys.executable, "-c", "import os, sys; "
                              "print(os.getpid(), flush=True); sys.stdin.read()"],
                             env=env, stdin=subprocess.PIPE)
sys.stdin.read()
if child is not None:
    child.stdin.close()
    child.wait()
"""


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[object]:
    """Start process trees; each call returns the pids (process, then its child)."""
    started: list[subprocess.Popen[str]] = []

    def start(job_env: str | None, *child_env: str) -> list[int]:
        env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
        if job_env is not None:
            env["SLURM_JOB_ID"] = job_env
        process = subprocess.Popen(
            [sys.executable, "-c", TREE, *child_env],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        assert process.stdout is not None
        return [int(process.stdout.readline()) for _ in range(2 if child_env else 1)]

    yield start
    for process in started:
        process.communicate(timeout=30)


def _jobs(pid: int, cgroup_fs: Path) -> set[str]:
    return job_of_process(pid, os.geteuid(), cgroup_fs=cgroup_fs)


def test_the_environment_the_process_started_with(tree, tmp_path: Path) -> None:
    (with_job,) = tree("123")
    (without,) = tree(None)
    assert _jobs(with_job, tmp_path) == {"123"}
    # the 999 it put in os.environ after starting is not the kernel's copy
    assert _jobs(without, tmp_path) == set()


def test_ancestors_of_the_same_user_count_too(tree, tmp_path: Path) -> None:
    _, cleaned = tree("123", "KEEP=1")  # a child started without SLURM_JOB_ID
    _, other = tree("123", "SLURM_JOB_ID=666")  # a child that names another job
    assert _jobs(cleaned, tmp_path) == {"123"}
    assert _jobs(other, tmp_path) == {"123", "666"}  # never one job: not believed


def test_a_job_cgroup_is_the_answer_and_confinement_overrides_the_environment(
    tree, tmp_path: Path
) -> None:
    assert (
        job_of_cgroup("0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n") == "77"
    )
    assert job_of_cgroup("4:memory:/slurm/uid_1000/job_5/step_0/task_0\n1:cpu:/\n") == "5"
    assert job_of_cgroup("4:memory:/process_api/job_x\n0::/\n") is None
    (with_job,) = tree("123")
    assert not slurm_confines_in_cgroups(tmp_path)
    (tmp_path / "freezer" / "slurm").mkdir(parents=True)  # Slurm's v1 hierarchy
    assert slurm_confines_in_cgroups(tmp_path)
    # this process lies in no job's cgroup: on such a node its environment is not enough
    assert Path(f"/proc/{with_job}/cgroup").read_text().count("job_") == 0
    assert _jobs(with_job, tmp_path) == set()


def test_the_check_keeps_true_ids_and_drops_forged_ones_once_logged(
    tree, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    check = JobIdCheck(cgroup_fs=tmp_path)
    (with_job,) = tree("123")
    (without,) = tree(None)
    me = (os.geteuid(), os.getegid())
    with caplog.at_level(logging.WARNING, logger="sidecar"):
        assert check.believed("123", Peer(*me, with_job)) == "123"
        assert check.believed(None, Peer(*me, without)) is None
        assert check.believed("666", Peer(*me, without)) is None
        assert check.believed("666", Peer(*me, with_job)) is None
        assert check.believed("123", Peer(*me, 2**22 + 1)) is None  # no such process
    assert check.dropped == 3
    dropped = [r.getMessage() for r in caplog.records if "Slurm job id" in r.getMessage()]
    assert len(dropped) == 1 and "'666'" in dropped[0] and "no Slurm job" in dropped[0]


def test_a_run_found_dead_before_the_epilog_takes_the_jobs_end_as_its_cause(tmp_path: Path) -> None:
    gone = "process 7 ended without finish() (killed, ...)"
    epilog_unix = 1000.0

    def ended(index: int, status: str, cause: str | None, seconds_before: float) -> Split:
        split = Split(tmp_path, index, Settings(), {"job_id": "5"})
        split.set_status(status, cause)
        split.end_unix, split.dirty = epilog_unix - seconds_before, False
        return split

    killed = ended(0, "incomplete", gone, 2.0)
    assert ended_by_job(killed, gone, "Slurm job 5 ended", epilog_unix)
    assert (killed.status, killed.cause, killed.dirty) == ("incomplete", "Slurm job 5 ended", True)
    kept = [
        ended(1, "failed", "RuntimeError: boom", 2.0),  # its own end
        ended(2, "completed", None, 2.0),
        ended(3, "incomplete", gone, 3600.0),
    ]  # died an hour before the job ended
    for split in kept:
        assert not ended_by_job(split, gone, "Slurm job 5 ended", epilog_unix)
    assert [(s.status, s.cause, s.dirty) for s in kept] == [
        ("failed", "RuntimeError: boom", False),
        ("completed", None, False),
        ("incomplete", gone, False),
    ]
