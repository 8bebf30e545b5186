"""Who sees which runs in ``/metrics`` (docs/node-daemon.md, "Who sees what").

A tcp scrape cannot tell users apart, so a shared daemon decides by the bearer token the
scrape shows (``Authorization: Bearer TOKEN``):

* none, or one it does not know: the node-wide figures only (counts of runs, GPUs,
  dropped job ids), never a run id, user, job id or phase;
* the admin's, read from ``--metrics-token-file`` (a file only root, or the group of
  the Prometheus server, can read): every run;
* a user's own: that user's runs. The daemon draws one per user and daemon process and
  leaves it in ``ROOT/<user>/.metrics-token``, 0600, written as that user (so the kernel
  keeps it theirs), when the user's first run says hello.

A daemon that is not shared serves one user: every scrape sees every run, as before.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from sidecar.daemon.users import acting_as
from sidecar.ingest.peers import Peer

log = logging.getLogger("sidecar")

ALL = "*"  # a viewer that sees every run
TOKEN_FILE = ".metrics-token"


def read_token(path: Path) -> str:
    """The token in ``path`` (surrounding blanks removed). Raises OSError when it cannot
    be read, ValueError when it is empty."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token


class Viewers:
    """Maps a scrape's ``Authorization`` header to what it may see: ``ALL``, a user name,
    or None (the node-wide figures only). ``admin_token``: the admin's (None: no scrape
    sees all runs of a shared daemon)."""

    def __init__(self, shared: bool, admin_token: str | None = None) -> None:
        self.shared = shared
        self._admin = admin_token
        self._users: dict[str, str] = {}  # token -> user name; replaced whole, never edited
        self._issued: set[int] = set()  # uids given a token by this process

    def viewer(self, authorization: str | None) -> str | None:
        """What a scrape with this header may see."""
        if not self.shared:
            return ALL
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        if self._admin is not None and secrets.compare_digest(token, self._admin):
            return ALL
        return self._users.get(token)

    def issue(self, folder: Path, peer: Peer) -> None:
        """Leave ``peer`` a token of their own in ``folder/.metrics-token`` (once per
        process; the file replaced as the user, never through a link). A file that cannot
        be written is logged: that user's scrapes then see the node-wide figures only."""
        if not self.shared or peer.uid in self._issued:
            return
        token = secrets.token_hex(16)
        path = folder / TOKEN_FILE
        tmp = folder / f"{TOKEN_FILE}.tmp"
        try:
            with acting_as(peer.uid, peer.gid):
                tmp.unlink(missing_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(token + "\n")
                os.replace(tmp, path)
        except OSError as exc:
            log.warning(
                "metrics: cannot leave %s its token in %s (%s)",
                peer.name,
                path,
                exc.strerror or exc,
            )
            return
        self._issued.add(peer.uid)
        self._users = {**{t: u for t, u in self._users.items() if u != peer.name}, token: peer.name}
