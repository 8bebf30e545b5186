"""The Slurm job id a shared node daemon keeps for a run: believed only when the kernel
shows that the connection's process belongs to that job.

A hello's ``job_id`` is whatever the markers found in ``SLURM_JOB_ID``; any process can
claim any job. A forged id would put the run in another job's rows of ``sidecar status
--job`` and of the report, and the root epilog's ``sidecar finish --job`` would end it
with that job. So the shared daemon looks at the process the kernel names for the
connection (its pid from the peer credentials):

- **Its cgroup.** Slurm's cgroup plugins (``proctrack/cgroup``, ``task/cgroup``) put every
  process of job N in a cgroup whose path has a ``job_N`` component
  (v1: ``/slurm/uid_U/job_N/step_S``; v2: ``/system.slice/slurmstepd.scope/job_N/...``),
  and a user's process cannot move out of it. When the process lies in such a cgroup,
  that is the answer. When this node's Slurm confines jobs in cgroups but the process
  lies outside every job's, it belongs to no job, whatever its environment says.
- **Otherwise its environment**, as the kernel keeps it in ``/proc/<pid>/environ`` (the
  environment the program was started with, not what the process set later): the
  process and each ancestor of the same user, up to the job step (``slurmstepd``, root's),
  that has ``SLURM_JOB_ID`` must name the claimed job, and at least one must.

The files are read acting as the process's user: reading another process's environment
needs the ptrace read check, which root without ``CAP_SYS_PTRACE`` (the systemd unit)
passes only for processes of the user it acts as.

The epilog's rule for runs whose processes Slurm killed before it ran is here too
(``ended_by_job``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sidecar.daemon.users import acting_as
from sidecar.ingest.peers import Peer
from sidecar.model.split import Split

log = logging.getLogger("sidecar")

PROC = Path("/proc")
CGROUP_FS = Path("/sys/fs/cgroup")
# Where Slurm's cgroup plugins keep their jobs: cgroup v2 (slurmd's scope), v1 (a
# ``slurm`` folder under any controller).
SLURM_CGROUP_PATTERNS = ("system.slice/slurmstepd.scope", "*/slurm")
JOB_COMPONENT = re.compile(r"^job_(\d+)$")
ENV_NAME = b"SLURM_JOB_ID="
MAX_ANCESTORS = 64  # a process tree deeper than this is not walked further
# Slurm kills a job's processes (SIGTERM, SIGKILL after KillWait, 30 s by default) before
# its epilog: a run whose process died this long before the epilog died with the job.
JOB_END_S = 120.0


def job_of_cgroup(text: str) -> str | None:
    """The Slurm job id in the cgroup paths of a ``/proc/<pid>/cgroup`` text (lines
    ``hierarchy:controllers:path``), or None when no path has a ``job_<id>`` component."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for component in path.split("/"):
            match = JOB_COMPONENT.match(component)
            if match:
                return match.group(1)
    return None


def job_of_environ(data: bytes) -> str | None:
    """``SLURM_JOB_ID`` in a ``/proc/<pid>/environ`` content (NUL-separated), or None."""
    for entry in data.split(b"\0"):
        if entry.startswith(ENV_NAME):
            return entry[len(ENV_NAME) :].decode(errors="replace")
    return None


def slurm_confines_in_cgroups(cgroup_fs: Path = CGROUP_FS) -> bool:
    """True when this node's Slurm keeps its jobs in cgroups (its cgroup folder exists)."""
    return any(any(cgroup_fs.glob(pattern)) for pattern in SLURM_CGROUP_PATTERNS)


def _parent(pid: int, proc: Path) -> int:
    """The parent pid of ``pid`` (0 when unknown). The command name in ``stat`` may hold
    spaces and parentheses: the fields after its last ``)`` are the kernel's own."""
    text = (proc / str(pid) / "stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


def _same_user_chain(pid: int, uid: int, proc: Path) -> Iterator[int]:
    """``pid`` and its ancestors while they belong to ``uid`` (the job step that started
    a job's processes is root's: the walk stops there)."""
    for _ in range(MAX_ANCESTORS):
        if pid <= 1 or (proc / str(pid)).stat().st_uid != uid:
            return
        yield pid
        pid = _parent(pid, proc)


def job_of_process(pid: int, uid: int, proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> set[str]:
    """The Slurm job ids the kernel shows for process ``pid`` of user ``uid`` (see the
    module's text): one id from its cgroup, else those its environment and its ancestors'
    name; empty when it belongs to no job. Raises OSError when its files cannot be read
    (the process is gone)."""
    cgroup_job = job_of_cgroup((proc / str(pid) / "cgroup").read_text())
    if cgroup_job is not None:
        return {cgroup_job}
    if slurm_confines_in_cgroups(cgroup_fs):
        return set()
    found = set()
    for member in _same_user_chain(pid, uid, proc):
        job = job_of_environ((proc / str(member) / "environ").read_bytes())
        if job is not None:
            found.add(job)
    return found


class JobIdCheck:
    """Keeps a hello's job id only when true; counts and logs (the first time) the ones
    dropped. ``dropped`` is the count since the daemon started."""

    def __init__(self, proc: Path = PROC, cgroup_fs: Path = CGROUP_FS) -> None:
        self.proc = proc
        self.cgroup_fs = cgroup_fs
        self.dropped = 0

    def believed(self, claimed: Any, peer: Peer) -> Any:
        """``claimed`` when the process of ``peer`` belongs to that Slurm job, else None
        (counted as dropped). What is no job id (None, not a string) is returned as it
        is, for the hello's checks to judge."""
        if not isinstance(claimed, str):
            return claimed
        try:
            with acting_as(peer.uid, peer.gid):
                jobs = job_of_process(peer.pid, peer.uid, self.proc, self.cgroup_fs)
        except (OSError, ValueError, IndexError) as exc:  # gone, or unreadable
            jobs, why = set(), f"its process cannot be read ({exc})"
        else:
            why = (
                f"its process belongs to Slurm job {', '.join(sorted(jobs))}"
                if jobs
                else "its process belongs to no Slurm job"
            )
        if jobs == {claimed}:
            return claimed
        if not self.dropped:
            log.warning(
                "dropped the Slurm job id %r of a hello from %s (pid %d): %s (further "
                "ones are counted as job_ids_dropped, not logged)",
                claimed,
                peer.name,
                peer.pid,
                why,
            )
        self.dropped += 1
        return None


def ended_by_job(split: Split, gone_cause: str, job_cause: str, now_unix: float) -> bool:
    """When Slurm ends a job (scancel, time limit) it kills the job's processes first and
    runs the epilog after: the daemon may have written a run ``incomplete`` with
    ``gone_cause`` (its process ended without finish()) already. Such a run that ended
    within ``JOB_END_S`` before the epilog (``now_unix``) ended with the job: its cause
    becomes ``job_cause``; one that died earlier keeps its own. True when ``split`` was
    changed (write it)."""
    if (
        split.status != "incomplete"
        or split.cause != gone_cause
        or split.end_unix is None
        or now_unix - split.end_unix > JOB_END_S
    ):
        return False
    split.cause = job_cause
    split.dirty = True
    return True
