"""Jobs under a real Slurm (Debian's slurmctld, slurmd and munge, started by the test) with
the repository's own TaskProlog and Epilog (systemd/slurm/) in slurm.conf, monitored by a
shared node daemon: a local user's batch jobs (Debian's Python, a readable copy of the
markers) are pointed at the daemon by the TaskProlog; their runs land in the user's folder,
owned by the user, under their Slurm job id; ``sidecar status --job`` shows one while it
trains; ``scancel`` ends another, which the Epilog writes incomplete with the cause "Slurm
job N ended"; ``sidecar report`` lists both under their job ids; a process outside Slurm
that claims a job id in its hello keeps none, and that job's epilog ends nothing of it.
Needs root.
"""

from __future__ import annotations

import csv
import os
import pwd
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import local_users, slurm
from tests.support.helpers import Sidecar, env, job_runs, run_json, sidecar_command, wait_for

WHY_NOT = slurm.unavailable() or local_users.unavailable() or local_users.user_python_unavailable()
pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=str(WHY_NOT)), slurm.ONE_AT_A_TIME]

# Until its stop file exists, the job trains (a plain loop with markers): the stop file is
# named after the job, so one script serves every job.
BATCH = """#!/bin/sh
export PYTHONPATH={site}
exec {python} -m jobs.loop_job --out-dir "maps/$SLURM_JOB_ID" --sleep 0.01 \\
    --stop-file "{work}/stop-$SLURM_JOB_ID"
"""
# A process outside Slurm whose hello claims job 666 (its environment names no job).
FORGER = """import os, runpy, sys
os.environ["SLURM_JOB_ID"] = "666"
sys.argv = ["loop_job", "--out-dir", "maps/forged", "--sleep", "0.01", "--stop-file", sys.argv[1]]
runpy.run_module("jobs.loop_job", run_name="__main__")
"""


def _running(endpoint: str, job: str) -> Callable[[], list[dict[str, Any]]]:
    """A predicate: the job's runs while one of them is running and has sent records."""
    return lambda: [
        run for run in job_runs(endpoint, job) if run["status"] == "running" and run["records"] > 0
    ]


def test_batch_jobs_under_slurm_and_the_node_daemon(
    short_tmp: Path, serve: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SIDECAR_ENDPOINT", raising=False)  # sbatch passes our environment
    short_tmp.chmod(0o755)
    site = local_users.readable_markers(short_tmp / "py")
    work = short_tmp / "work"
    work.mkdir(mode=0o777)
    work.chmod(0o777)
    sockets = short_tmp / "run"
    (sockets / "sidecar").mkdir(parents=True, mode=0o755)
    root = short_tmp / "root"  # made by ``serve``
    daemon = serve(endpoint=f"ipc://{sockets}/sidecar/sidecar.sock", root=root, args=["--shared"])
    endpoint = daemon.endpoint
    batch = slurm.script(
        work / "train.sh", BATCH.format(site=site, work=work, python=local_users.SYSTEM_PYTHON)
    )
    with (
        local_users.local_users(1, tag="j") as (user,),
        slurm.slurm(short_tmp / "slurm", **slurm.repository_scripts(short_tmp, sockets)) as cluster,
    ):
        uid = pwd.getpwnam(user).pw_uid
        trained = str(cluster.sbatch(batch, user=user, workdir=work))
        cancelled = str(cluster.sbatch(batch, user=user, workdir=work))
        forger = subprocess.Popen(
            [
                "runuser",
                "-u",
                user,
                "--",
                local_users.SYSTEM_PYTHON,
                "-c",
                FORGER,
                str(work / "stop-forged"),
            ],
            cwd=work,
            stdout=subprocess.DEVNULL,
            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(site), "SIDECAR_ENDPOINT": endpoint},
        )
        try:
            # `sidecar status --job` shows the job while it trains, under its user
            (run,) = wait_for(
                _running(endpoint, trained), 90, f"job {trained} training in `sidecar status --job`"
            )
            assert (run["user"], run["job_id"]) == (user, trained), run
            assert run["out_dir"] == str(root / user / "maps" / trained)
            (work / f"stop-{trained}").touch()
            cluster.wait_gone(int(trained))
            # scancel ends the other: its processes die, then the Epilog runs
            wait_for(_running(endpoint, cancelled), 90, f"job {cancelled} training")
            cluster.client("scancel", cancelled, user=user)
            cluster.wait_gone(int(cancelled))
            # the forger's run is served, without the job id it claimed; the epilog of
            # job 666 (the repository's, as root) leaves it running
            forged = wait_for(
                lambda: [
                    r
                    for r in daemon.status()["runs"]
                    if r["out_dir"].endswith("forged") and r["status"] == "running"
                ],
                60,
                "the forged run",
            )
            assert forged[0]["job_id"] is None and daemon.status()["job_ids_dropped"] == 1
            subprocess.run(
                [str(short_tmp / "epilog_here.sh")],
                check=True,
                timeout=60,
                env={**os.environ, "SLURM_JOB_ID": "666", "SLURM_JOB_USER": user},
            )
            assert [
                r["status"] for r in daemon.status()["runs"] if r["out_dir"].endswith("forged")
            ] == ["running"]
        finally:
            (work / "stop-forged").touch()
            forger.wait(60)
        slurm_log = cluster.log()
    folder = root / user / "maps"
    # the user's folder: every folder and file of the runs belongs to the user
    assert {path.lstat().st_uid for path in [root / user, *(root / user).rglob("*")]} == {uid}
    done, killed, forged_run = (run_json(folder / name) for name in (trained, cancelled, "forged"))
    assert (done["status"], done["job_id"], done["user"]) == ("completed", trained, user), slurm_log
    assert (killed["status"], killed["cause"]) == ("incomplete", f"Slurm job {cancelled} ended")
    assert (forged_run["status"], forged_run["job_id"]) == ("completed", None)
    # `sidecar report` over the root lists each run under its Slurm job id
    report = subprocess.run(
        sidecar_command("report", str(root), "--out", str(short_tmp / "report")),
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr
    with (short_tmp / "report" / "jobs.tsv").open() as table:
        rows = {Path(row["folder"]).name: row for row in csv.DictReader(table, delimiter="\t")}
    assert {
        name: (row["slurm_job_id"], row["user"], row["status"]) for name, row in rows.items()
    } == {
        trained: (trained, user, "completed"),
        cancelled: (cancelled, user, "incomplete"),
        "forged": ("", user, "completed"),
    }
