"""A real Slurm on this machine, for tests: munge, ``slurmctld`` and ``slurmd`` (Debian's
packages) started in the foreground from a ``slurm.conf`` in a temporary folder
(``SLURM_CONF``), with the prolog scripts a test names. Needs root; ready in about a
second. Nothing is installed under /etc: every path is the test's own.

One node (this host), or one per network namespace of ``tests.support.netns``: a
``slurmd`` in each, under the namespace's hostname and address, ``slurmctld`` and the
client commands in the first one. The nodes share munge's socket and the filesystem, as
nodes of a cluster share a munge key and a shared folder; each ``slurmd`` keeps its own
spool folder, pid and log file (``%n``: the node's name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import netns
from tests.support.helpers import REPO, wait_for

# Under xdist, the tests that start a Slurm share one worker, so one runs at a time: every
# cluster uses the host's one munged (the first started it and stops it on its exit) and
# the one-node clusters all name this host.
ONE_AT_A_TIME = pytest.mark.xdist_group("slurm")

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged", "munge")


def unavailable() -> str | None:
    """Why a real Slurm cannot run here (not root, a binary missing), or None."""
    if os.geteuid() != 0:
        return "a real Slurm needs root"
    missing = [name for name in BINARIES if shutil.which(name) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


SCRIPTS = REPO / "systemd" / "slurm"


def script(path: Path, text: str) -> Path:
    """Write an executable script; returns its path."""
    path.write_text(text)
    path.chmod(0o755)
    return path


def repository_scripts(folder: Path, sockets: Path) -> dict[str, Path]:
    """slurm.conf's script keys: the repository's TaskProlog and Epilog (systemd/slurm/),
    as installed on a node, with this worktree's sidecar command and ``sockets`` as the
    folder holding the daemons' socket folders (the node's /run). The TaskProlog runs as
    the job's user: a copy under ``folder``, where that user can read it."""
    cli = script(
        folder / "sidecar", f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m sidecar "$@"\n'
    )
    prolog = folder / "task_prolog.sh"
    shutil.copy(SCRIPTS / "task_prolog.sh", prolog)
    prolog.chmod(0o755)
    return {
        "TaskProlog": script(
            folder / "task_prolog_here.sh",
            f"#!/bin/sh\nexport SIDECAR_SOCKET_ROOT={sockets}\nexec {prolog}\n",
        ),
        "Epilog": script(
            folder / "epilog_here.sh",
            (
                f"#!/bin/sh\nexport SIDECAR={cli} SIDECAR_SOCKET_ROOT={sockets}\n"
                f"exec {SCRIPTS / 'epilog.sh'}\n"
            ),
        ),
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Slurm:
    """A running cluster; every client call carries ``SLURM_CONF`` and runs where
    ``slurmctld`` does (``controller``, a namespace; None: this host)."""

    folder: Path
    env: dict[str, str]
    node: str
    controller: netns.Node | None = None
    _daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run where ``slurmctld`` runs."""
        return list(command) if self.controller is None else self.controller.argv(command)

    def client(
        self,
        *argv: str,
        user: str | None = None,
        timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (as ``user`` when given); raises on a non-zero exit."""
        command = list(argv) if user is None else ["runuser", "-u", user, "--", *argv]
        return subprocess.run(
            self.argv(command),
            env={**self.env, **(env or {})},
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def sbatch(
        self,
        script: Path,
        *,
        user: str | None = None,
        workdir: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Submit ``script``; returns the job id at once (the job runs on its own)."""
        argv = ["sbatch", "--parsable"]
        if workdir is not None:
            argv.append(f"--chdir={workdir}")
        result = self.client(*argv, str(script), user=user, env=env)
        return int(result.stdout.strip().split(";")[0])

    def state(self, job_id: int) -> str:
        """The job's state as squeue tells it ("" once the job is gone from the queue)."""
        result = subprocess.run(
            self.argv(["squeue", "-h", "-j", str(job_id), "-o", "%T"]),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return result.stdout.strip()

    def wait_gone(self, job_id: int, timeout_s: float = 120.0) -> None:
        """Wait until the job left the queue: its Epilog has finished then (``sbatch
        --wait`` returns before)."""
        wait_for(
            lambda: self.state(job_id) == "",
            timeout_s,
            f"job {job_id} to leave squeue",
            interval_s=0.2,
        )

    def wait_running(self, job_id: int, timeout_s: float = 60.0) -> None:
        """Wait until the job runs."""
        wait_for(
            lambda: self.state(job_id) == "RUNNING",
            timeout_s,
            f"job {job_id} to run",
            interval_s=0.1,
        )

    def log(self) -> str:
        """The daemons' logs, for assertion messages."""
        return "\n".join(
            path.read_text(errors="replace")
            for path in [self.folder / "slurmctld.log", *sorted(self.folder.glob("slurmd-*.log"))]
            if path.exists()
        )


def _conf(
    folder: Path, nodes: Sequence[tuple[str, str | None]], scripts: Mapping[str, Path]
) -> str:
    """slurm.conf for ``nodes`` (name, address or None for the name's own); the first
    one holds ``slurmctld``."""
    controller, address = nodes[0]
    lines = [
        "ClusterName=ci",
        f"SlurmctldHost={controller}" + (f"({address})" if address else ""),
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool-%n'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        *(f"{key}={path}" for key, path in scripts.items()),
        *(
            f"NodeName={name}"
            + (f" NodeAddr={addr}" if addr else "")
            + f" CPUs={os.cpu_count() or 2} RealMemory=1000 State=UNKNOWN"
            for name, addr in nodes
        ),
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _munge() -> Iterator[None]:
    """munged running (started here when it is not, and stopped again)."""
    if subprocess.run(["munge", "-n"], capture_output=True, timeout=10).returncode == 0:
        yield
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create"], check=True, capture_output=True, timeout=60)
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    daemon = subprocess.Popen(
        ["runuser", "-u", "munge", "--", "munged", "--foreground"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: (
                subprocess.run(["munge", "-n"], capture_output=True, timeout=10).returncode == 0
            ),
            30,
            "munged",
        )
        yield
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def _cancel_jobs(cluster: Slurm, timeout_s: float = 60.0) -> None:
    """Cancel the jobs still in the queue (a test that failed midway) and wait until they
    left it: a job step's ``slurmstepd`` outlives ``slurmd``, so a job left behind would
    go on running after the cluster stopped."""
    with contextlib.suppress(subprocess.SubprocessError, AssertionError):
        jobs = subprocess.run(
            cluster.argv(["squeue", "-h", "-o", "%i"]),
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        if jobs:
            cluster.client("scancel", *jobs, timeout_s=30)
            for job in jobs:
                cluster.wait_gone(int(job), timeout_s)


def _idle(cluster: Slurm, count: int) -> bool:
    states = subprocess.run(
        cluster.argv(["sinfo", "-h", "-N", "-o", "%T"]),
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.split()
    return states == ["idle"] * count


@contextlib.contextmanager
def slurm(folder: Path, nodes: Sequence[netns.Node] = (), /, **scripts: Path) -> Iterator[Slurm]:
    """A Slurm whose configuration lives in ``folder``: one node (this host), or one per
    namespace of ``nodes`` (``slurmctld`` in the first); ``scripts`` are slurm.conf keys
    (``TaskProlog=``, ``Epilog=``, ``Prolog=``) with absolute paths. Stops every daemon
    (and their jobs) on exit."""
    named: list[tuple[str, str | None]] = [(node.hostname, node.address) for node in nodes]
    named = named or [(socket.gethostname().split(".")[0], None)]
    for name in ["state", *(f"spool-{name}" for name, _ in named)]:
        (folder / name).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, named, scripts))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    with _munge():
        cluster = Slurm(folder, env, named[0][0], nodes[0] if nodes else None)
        try:
            hosts: list[netns.Node | None] = [*nodes] or [None]
            for node, daemon in [
                (cluster.controller, "slurmctld"),
                *((n, "slurmd") for n in hosts),
            ]:
                cluster._daemons.append(
                    subprocess.Popen(
                        [daemon, "-D"] if node is None else node.argv([daemon, "-D"]),
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            wait_for(lambda: _idle(cluster, len(named)), 60, "every Slurm node to be idle")
            yield cluster
        finally:
            _cancel_jobs(cluster)
            for daemon_process in reversed(cluster._daemons):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon_process.pid, signal.SIGTERM)
            for daemon_process in cluster._daemons:
                try:
                    daemon_process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon_process.pid, signal.SIGKILL)
                    daemon_process.wait(timeout=30)
