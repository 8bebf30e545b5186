"""``python -m tests.support.as_user USER ARGS...``: ``sidecar ARGS`` run as ``USER``.

The project's Python may lie where other users cannot enter (``/root/.pyenv``), so it is
started as root, imports what the command needs, then switches to the user before the
command connects: the sidecar's kernel-given peer is the user. Rich loads parts of itself
on first use; one view is drawn into nothing first, as root, to load them.
"""

from __future__ import annotations

import io
import os
import pwd
import sys

from rich.console import Console

from sidecar.cli import main
from sidecar.views import top


def _as(user: str) -> None:
    account = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(account.pw_gid)
    os.setuid(account.pw_uid)


if __name__ == "__main__":
    board = top.Board(None, None)
    Console(file=io.StringIO(), width=top.WIDTH, force_terminal=True).print(board.render())
    _as(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
