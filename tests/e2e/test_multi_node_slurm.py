"""Launch shapes of a multi-rank job under a real Slurm (Debian's slurmctld, slurmd and
munge, started by the test; docs/multi-node.md):

* ``srun sidecar run -- python train.py`` on one node: one sidecar per task, each serving
  its one rank of one split;
* a node daemon on each node, pointed at by the repository's TaskProlog: two ``slurmd``
  nodes, each in its own network namespace with its own hostname and its own /run (where
  its daemon's socket lies), a non-root user's ``sbatch`` of 2 nodes × 2 tasks, the run
  written in the user's own folder.

Every rank is measured, each rank's rows match its own clock, and the sidecar serving
rank 0 names the rank slowed on purpose. Needs root.
"""

from __future__ import annotations

import functools
import os
import pwd
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_multi_node import (
    FORWARD_S,
    ITERS,
    JOB,
    SLOW_RANK,
    SLOW_S,
    WARMUP,
    check_ranks_match_their_clocks,
    check_straggler,
)
from tests.support import local_users, netns, shared_node, slurm
from tests.support.helpers import (
    REPO,
    Sidecar,
    env,
    job_runs,
    run_json,
    split_dir,
    wait_for,
)

pytestmark = [
    pytest.mark.skipif(bool(slurm.unavailable()), reason=str(slurm.unavailable())),
    slurm.ONE_AT_A_TIME,
]
# Every rank's loop: its length, its warmup, its forward and the slowed rank's extra time.
LOOP = {"iters": ITERS, "warmup": WARMUP, "forward_s": FORWARD_S, "slow_s": SLOW_S}
NODES_WHY_NOT = (
    netns.unavailable() or local_users.unavailable() or local_users.user_python_unavailable()
)

# srun gives each task SLURM_PROCID and SLURM_NTASKS; the job maps them to RANK and
# WORLD_SIZE as a launcher script would.
BATCH = """#!/bin/sh
#SBATCH --ntasks=2
srun --ntasks=2 sh -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS exec {python} -m sidecar \\
    run --nice 0 -- {python} {job} --truth {truth} --iters {iters} --warmup {warmup} \\
    --forward-s {forward_s} --slow-rank 1 --slow-s {slow_s}'
"""


def test_srun_one_sidecar_per_task(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    work = short_tmp / "work"
    work.mkdir()
    script = work / "train.sh"
    script.write_text(BATCH.format(python=sys.executable, job=JOB, truth=truth, **LOOP))
    script.chmod(0o755)
    with slurm.slurm(short_tmp / "slurm") as cluster:
        job_id = cluster.sbatch(script, workdir=work, env=env(PYTHONPATH=str(REPO)))
        cluster.wait_gone(job_id, timeout_s=180)
        log = cluster.log()
    folder = work / "maps"
    assert (folder / "run.json").exists(), log
    check_ranks_match_their_clocks(folder, truth, range(2))
    entry = run_json(folder)["splits"]["0"]
    assert entry["ranks"] == [0, 1] and len(entry["nodes"]) == 2, entry
    assert entry["status"] == "completed", entry
    summary = (split_dir(folder) / "summary.log").read_text()
    assert f"Straggler: rank 1 on {socket.gethostname()}, data loading" in summary, summary


# Two nodes, two tasks each, one rank per task: srun gives the rank and world size, the
# TaskProlog the node daemon's endpoint. The ranks keep their runs open until the hold
# file exists, so the test sees them live.
DAEMONS_BATCH = """#!/bin/sh
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
export PYTHONPATH={site}
exec srun sh -c 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS \\
    exec {python} -m jobs.ranks_job --out-dir "maps/$SLURM_JOB_ID" --truth {work}/truth \\
    --iters {iters} --warmup {warmup} --forward-s {forward_s} --slow-rank {slow_rank} \\
    --slow-s {slow_s} --hold-file {work}/hold'
"""


def _user_folder(path: Path, user: str) -> Path:
    """``path`` made a folder of ``user``'s own (0700), as a home or scratch folder is."""
    path.mkdir()
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(0o700)
    return path


def _node_daemon(
    serve: Callable[..., Sidecar], short_tmp: Path, node: netns.Node, work: Path
) -> Sidecar:
    """The shared node daemon of ``node``: its socket in the node's own /run folder, its
    root on the node, the user's folder allowed."""
    root = short_tmp / f"root-{node.hostname}"
    root.mkdir()
    own_run = node.binds[0][0]
    return serve(
        endpoint=f"ipc://{own_run}/sidecar/sidecar.sock",
        root=root,
        args=["--shared", "--allow", str(work)],
        wrap=node.argv,
    )


def _live_runs(endpoint: str, job: str, count: int) -> list[dict[str, Any]]:
    """The job's runs on the sidecar at ``endpoint`` once ``count`` of them are running
    and have sent records; [] before."""
    runs = [r for r in job_runs(endpoint, job) if r["status"] == "running" and r["records"] > 0]
    return runs if len(runs) == count else []


def _diagnosis(
    cluster: slurm.Slurm, work: Path, job: str, short_tmp: Path, daemons: list[Sidecar]
) -> str:
    """What the job printed, what the node daemons show of it and the ends of their and
    Slurm's logs, for a failure message."""
    shown = [f"--- status on {d.endpoint}: {job_runs(d.endpoint, job)}" for d in daemons]
    texts = [
        f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
        for path in (work / f"slurm-{job}.out", short_tmp / "sidecar.log")
        if path.exists()
    ]
    return "\n".join([*shown, *texts, f"--- slurm\n{cluster.log()[-3000:]}"])


def _final(folder: Path) -> bool:
    """The split completed and rank 0's sidecar wrote its summary for good."""
    summary = split_dir(folder) / "summary.log"
    return (
        run_json(folder).get("splits", {}).get("0", {}).get("status") == "completed"
        and summary.exists()
        and "Nodes: waited" in summary.read_text()
    )


@pytest.mark.skipif(bool(NODES_WHY_NOT), reason=str(NODES_WHY_NOT))
def test_sbatch_on_two_nodes_under_their_node_daemons(
    short_tmp: Path, serve: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SIDECAR_ENDPOINT", raising=False)  # sbatch passes our environment
    site = shared_node.prepare(short_tmp)
    run = short_tmp / "run"  # the path of /run on every node: each node sees its own
    run.mkdir()
    with (
        local_users.local_users(1, tag="n") as (user,),
        netns.nodes() as namespaces,
    ):
        nodes = []
        for namespace in namespaces:
            own_run = short_tmp / f"run-{namespace.hostname}"
            (own_run / "sidecar").mkdir(parents=True)
            nodes.append(namespace.with_binds((own_run, run)))
        work = _user_folder(short_tmp / "work", user)
        _user_folder(work / "truth", user)
        batch = slurm.script(
            short_tmp / "train.sh",
            DAEMONS_BATCH.format(
                site=site, python=local_users.SYSTEM_PYTHON, work=work, slow_rank=SLOW_RANK, **LOOP
            ),
        )
        daemons = [_node_daemon(serve, short_tmp, node, work) for node in nodes]
        scripts = slurm.repository_scripts(short_tmp, run)
        with slurm.slurm(short_tmp / "slurm", nodes, **scripts) as cluster:
            job = str(cluster.sbatch(batch, user=user, workdir=work))
            try:
                # each node's daemon shows that node's two ranks of the job while they run
                for node, daemon, ranks in zip(nodes, daemons, ([0, 1], [2, 3]), strict=True):
                    live = wait_for(
                        functools.partial(_live_runs, daemon.endpoint, job, 2),
                        90,
                        f"job {job}'s ranks on {node.hostname} in `sidecar status --job`",
                    )
                    assert sorted(r["rank"] for r in live) == ranks, live
                    assert {(r["user"], r["job_id"], r["host"]) for r in live} == {
                        (user, job, node.hostname)
                    }, live
                (work / "hold").touch()
                cluster.wait_gone(int(job), timeout_s=120)
                folder = work / "maps" / job
                wait_for(lambda: _final(folder), 90, "rank 0's final summary")
            except AssertionError as failed:
                why = _diagnosis(cluster, work, job, short_tmp, daemons)
                raise AssertionError(f"{failed}\n{why}") from None
            log = cluster.log()
        for daemon in daemons:
            daemon.stop()
        uid = pwd.getpwnam(user).pw_uid
        # the user's own folder: every folder and file of the run belongs to the user
        assert {p.lstat().st_uid for p in [folder, *folder.rglob("*")]} == {uid}, log
    check_ranks_match_their_clocks(folder, work / "truth", range(4))
    meta = run_json(folder)
    assert (meta["job_id"], meta["user"]) == (job, user), meta
    entry = meta["splits"]["0"]
    assert entry["hosts"] == {"node0": [0, 1], "node1": [2, 3]}, entry
    assert len(entry["nodes"]) == 2 and entry["status"] == "completed", entry
    summary = (split_dir(folder) / "summary.log").read_text()
    check_straggler(summary, "node1")  # in rank 0's summary, written on node0
    assert "Host node1 (ranks 2, 3" in summary, summary
