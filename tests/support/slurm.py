"""A real Slurm on this machine, for tests: munge, ``slurmctld`` and ``slurmd`` (Debian's
packages) started in the foreground from a ``slurm.conf`` in a temporary folder
(``SLURM_CONF``), with the prolog scripts a test names. Needs root; ready in about a
second. Nothing is installed under /etc: every path is the test's own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.helpers import wait_for

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged", "munge")


def unavailable() -> str | None:
    """Why a real Slurm cannot run here (not root, a binary missing), or None."""
    if os.geteuid() != 0:
        return "a real Slurm needs root"
    missing = [name for name in BINARIES if shutil.which(name) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Slurm:
    """A running one-node cluster; every client call carries ``SLURM_CONF``."""

    folder: Path
    env: dict[str, str]
    node: str
    _daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

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
            command,
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
            ["squeue", "-h", "-j", str(job_id), "-o", "%T"],
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
        """Both daemons' logs, for assertion messages."""
        return "\n".join(
            (self.folder / name).read_text(errors="replace")
            for name in ("slurmctld.log", "slurmd.log")
            if (self.folder / name).exists()
        )


def _conf(folder: Path, node: str, scripts: Mapping[str, Path]) -> str:
    lines = [
        "ClusterName=ci",
        f"SlurmctldHost={node}",
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
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        *(f"{key}={path}" for key, path in scripts.items()),
        f"NodeName={node} CPUs={os.cpu_count() or 2} RealMemory=1000 State=UNKNOWN",
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


@contextlib.contextmanager
def slurm(folder: Path, **scripts: Path) -> Iterator[Slurm]:
    """A one-node Slurm whose configuration lives in ``folder``; ``scripts`` are
    slurm.conf keys (``TaskProlog=``, ``Epilog=``, ``Prolog=``) with absolute paths.
    Stops both daemons (and their jobs) on exit."""
    node = socket.gethostname().split(".")[0]
    for name in ("state", "spool"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(_conf(folder, node, scripts))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    with _munge():
        cluster = Slurm(folder, env, node)
        try:
            for daemon in ("slurmctld", "slurmd"):
                cluster._daemons.append(
                    subprocess.Popen(
                        [daemon, "-D"],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            wait_for(
                lambda: (
                    subprocess.run(
                        ["sinfo", "-h", "-o", "%T"],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=10,
                    ).stdout.strip()
                    == "idle"
                ),
                60,
                "the Slurm node to be idle",
            )
            yield cluster
        finally:
            for daemon_process in reversed(cluster._daemons):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon_process.pid, signal.SIGTERM)
            for daemon_process in cluster._daemons:
                try:
                    daemon_process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon_process.pid, signal.SIGKILL)
                    daemon_process.wait(timeout=30)
