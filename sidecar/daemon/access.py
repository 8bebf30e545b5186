"""Who may use a sidecar, for what, and where it may write.

A daemon serves its own user and root; a shared one (``serve --shared``, root, ipc)
serves every user the kernel names, each only for their own runs: their hello's user,
pid and host are the kernel's, their folder is ``root/<user>``, every file access made
for them runs as them (``users.acting_as``) and they see and end only their own runs.
Without peer credentials (tcp) nobody is refused here. Every rank of a split is claimed
before it is written (one writer per split and rank, across sidecars: the ranks of one
split may be served by one sidecar per node).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from markers import wire
from sidecar.daemon import slurm_jobs
from sidecar.daemon.policy import OutDirPolicy
from sidecar.daemon.users import ForeignFolder, acting_as, user_folder
from sidecar.daemon.viewers import Viewers
from sidecar.ingest.hello_check import Refused
from sidecar.ingest.peers import Peer, user_name
from sidecar.ingest.resume import Claim
from sidecar.ingest.stream import HOSTNAME, Stream
from sidecar.sinks.locks import Busy, SplitClaim

log = logging.getLogger("sidecar")


class Access:
    """The access rules of one sidecar: ``root`` None is a job's own sidecar (writes
    where its job says), ``shared`` a daemon for every local user."""

    def __init__(
        self,
        root: Path | None,
        shared: bool,
        viewers: Viewers | None = None,
        allowed: tuple[Path, ...] = (),
    ) -> None:
        self.root = root
        self.shared = shared
        self.viewers = viewers or Viewers(shared)  # who sees which runs in /metrics
        self.policy = OutDirPolicy(root, shared, allowed)  # allowed: users' own folders
        self.job_ids = slurm_jobs.JobIdCheck()  # the Slurm job ids of hellos (shared)

    def foreign(self, peer: Peer | None, stream: Stream | None) -> str | None:
        """Why the sender ``peer`` (the kernel's word; None over tcp) of a message about
        ``stream`` (None: a run not known yet) may not use this sidecar, or None."""
        if self.shared:
            if peer is None:
                return "a shared daemon serves only clients of its ipc socket"
            if stream is not None and stream.owner is not None and stream.owner.uid != peer.uid:
                return f"run {stream.key} belongs to {stream.owner.name}, not {peer.name}"
            return None
        if peer is not None and peer.uid not in (os.geteuid(), 0):
            return (
                f"user {peer.name} may not use the sidecar of {user_name(os.geteuid())}; "
                "use your own or the node's shared one"
            )
        return None

    def take_hello(self, body: dict[str, Any], peer: Peer | None, known: bool) -> None:
        """On a shared daemon: the kernel's user, pid and host replace what a hello
        claims, its Slurm job id is kept only when the process belongs to that job (checked
        once per run: a ``known`` run's repeated hellos change nothing), and the user's
        folder is made (as root, before acting as the user) and holds the user's /metrics
        token. Raises Refused when that folder cannot be used."""
        if not self.shared or peer is None or body.get("type") != wire.HELLO:
            return
        body.update(user=peer.name, pid=peer.pid, host=HOSTNAME)
        if not known:
            body["job_id"] = self.job_ids.believed(body.get("job_id"), peer)
        assert self.root is not None  # a shared daemon always has its root
        try:
            folder = user_folder(self.root.resolve(), peer)
        except (ForeignFolder, OSError) as exc:
            raise Refused(str(exc)) from None
        self.viewers.issue(folder, peer)

    def say_where(self, hello: dict[str, Any], reply: dict[str, Any]) -> None:
        """On a shared daemon, tell a job whose run is written elsewhere than the folder
        it named (relative to its working folder) where it goes, and why (in the reply to
        its first hello)."""
        if not self.shared or reply.get("warning") or hello.get("repeat"):
            return
        asked = os.path.normpath(os.path.join(hello.get("cwd", "/"), hello["out_dir"]))
        if reply.get("out_dir") != asked:
            reply["warning"] = (
                f"this run is written in {reply.get('out_dir')}: {asked} lies "
                "under no folder this daemon may write for you (its --allow "
                "roots)"
            )

    def acting(self, user: Peer | None) -> contextlib.AbstractContextManager[None]:
        """On a shared daemon, file access as ``user`` within the block."""
        if not self.shared or user is None:
            return contextlib.nullcontext()
        return acting_as(user.uid, user.gid)

    def sees_all(self, caller: Peer | None) -> bool:
        """True when ``caller`` may see and end every run: anyone but on a shared
        daemon, where only root may (others only their own)."""
        return not self.shared or caller is None or caller.uid == 0

    def may_see(self, caller: Peer | None, user: str | None) -> bool:
        """Whether ``caller`` may see a run of ``user`` in the status view."""
        return self.sees_all(caller) or (caller is not None and user == caller.name)

    def may_end(self, caller: Peer | None, stream: Stream) -> bool:
        """Whether ``caller`` may end ``stream`` (``sidecar finish --job``)."""
        if self.sees_all(caller):
            return True
        return caller is not None and stream.owner is not None and stream.owner.uid == caller.uid

    def write_refusal(self, folder: Path, owner: Peer | None) -> str | None:
        """Why ``folder`` may not be written now for ``owner`` (``OutDirPolicy.refusal``)."""
        return self.policy.refusal(folder, owner)


def claim_split(split_dir: Path, rank: int) -> Claim | None:
    """Claim ``rank`` of a split's folder for this sidecar (one writer per split and rank).
    Raises Refused when another live sidecar holds it; None when the folder cannot be
    used now (the writes will say why, and retry)."""
    try:
        return SplitClaim(split_dir, rank)
    except Busy as exc:
        holder = exc.holder
        known = holder.get("ranks")
        runs: dict[str, Any] = known if isinstance(known, dict) else {}
        names = (
            ", ".join(
                f"run {str(r.get('run_id'))[:8]} (pid {r.get('pid')})"
                for r in runs.values()
                if isinstance(r, dict)
            )
            or "another run"
        )
        raise Refused(
            f"{split_dir} (rank {rank}) is being written by {names} under the "
            f"sidecar pid {holder.get('sidecar_pid')} on {holder.get('host')}; "
            "one writer per split and rank: this run is not monitored"
        ) from None
    except OSError as exc:  # the writes will say it, and retry
        log.warning(
            "cannot claim %s (%s); writing it anyway when possible", split_dir, exc.strerror or exc
        )
        return None
