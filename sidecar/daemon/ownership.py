"""Who a run belongs to, for good: the kernel's user that started it and a token only its
own process holds (docs/node-daemon.md, "What a neighbour cannot do").

The markers draw a random token per run and send it in every hello (``markers.start``);
the first hello accepted for a run id binds that id to the sender's uid (the kernel's
word, None over tcp) and to the token's SHA-256. From then on a hello carrying that run
id must come from the same uid with the same token, and every other message about it
from the same uid; anything else is refused and changes nothing.

A shared daemon keeps the bindings in ``ROOT/.sidecar-runs.json`` (root's, 0600),
rewritten whenever one is added or dropped: a daemon started after a crash or a watchdog
restart knows every run it must keep for its user before any hello arrives. Other
sidecars serve one user (and root) and keep them in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sidecar.ingest.peers import Peer, user_name

log = logging.getLogger("sidecar")

FILE_NAME = ".sidecar-runs.json"
# The run id of requests about no run (status, finish --job): never a run's, or one
# user's hello could bind it and turn away everyone else's status requests.
NO_RUN = bytes(16)


def token_hash(token: Any) -> str | None:
    """The hex SHA-256 of a hello's ``token`` (None for a hello without one)."""
    if not isinstance(token, str) or not token:
        return None
    return hashlib.sha256(token.encode()).hexdigest()


class Owners:
    """The run id -> owner bindings of one sidecar; ``folder`` None keeps them in memory
    only (a job's own sidecar)."""

    def __init__(self, folder: Path | None) -> None:
        self.path = folder / FILE_NAME if folder is not None else None
        self._bound: dict[str, dict[str, Any]] = self._load()
        # when each binding was made or loaded: one loaded after a restart is kept a while
        # for its run to come back, however long ago it was made
        now_unix = time.time()
        self._since = dict.fromkeys(self._bound, now_unix)

    def _load(self) -> dict[str, dict[str, Any]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.error(
                "cannot read the run owners in %s (%s); runs already bound are "
                "bound again by their next hello",
                self.path,
                exc,
            )
            return {}
        return (
            {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}
        )

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump(self._bound, handle)
            os.replace(tmp, self.path)
        except OSError as exc:  # the bindings still hold in memory
            tmp.unlink(missing_ok=True)
            log.error("cannot save the run owners in %s: %s", self.path, exc.strerror or exc)

    def refusal(
        self,
        run_id: bytes,
        peer: Peer | None,
        hello: dict[str, Any] | None,
    ) -> tuple[str, str] | None:
        """(the reject kind, why) when a message about ``run_id`` from ``peer`` (the
        kernel's word; None over tcp) may not be taken: ``foreign_user`` from another
        user, ``foreign_run`` a hello without the run's token. ``hello`` is the body of a
        hello, None for any other message. None when it may."""
        if hello is not None and run_id == NO_RUN:
            return "malformed", "run id 0 names no run (requests about none use it)"
        bound = self._bound.get(run_id.hex())
        if bound is None:
            return None
        owner = bound.get("uid")
        if owner is not None and peer is not None and peer.uid != owner:
            return "foreign_user", (
                f"run {run_id.hex()[:8]} belongs to {user_name(owner)}, not {peer.name}"
            )
        if (
            hello is not None
            and bound.get("token_sha256") is not None
            and token_hash(hello.get("token")) != bound["token_sha256"]
        ):
            return "foreign_run", (
                f"run {run_id.hex()[:8]} belongs to another process "
                "(its hello lacks the run's token)"
            )
        return None

    def bind(self, run_id: bytes, peer: Peer | None, hello: dict[str, Any]) -> None:
        """Bind ``run_id`` to ``peer``'s uid and the hello's token (once; saved)."""
        key = run_id.hex()
        if key in self._bound:
            return
        self._bound[key] = {
            "uid": peer.uid if peer is not None else None,
            "token_sha256": token_hash(hello.get("token")),
        }
        self._since[key] = time.time()
        self._save()

    def forget(self, known: Iterable[bytes], now_unix: float, keep_s: float) -> None:
        """Drop the bindings of runs not in ``known`` (the runs held in memory) bound more
        than ``keep_s`` seconds ago (saved when any is dropped)."""
        live = {run_id.hex() for run_id in known}
        old = [k for k in self._bound if k not in live and now_unix - self._since[k] > keep_s]
        for key in old:
            del self._bound[key]
            del self._since[key]
        if old:
            self._save()
