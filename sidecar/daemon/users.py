"""Users kept apart on a shared node daemon (``sidecar serve --shared``; docs/contract.md,
Faults and bad input "another user's folder", and Node daemon).

A shared daemon runs as root and knows each connection's user from the kernel
(``sidecar.ingest.peers``). Each user's runs go under ``ROOT/<user>/``, a folder created
0700 and owned by that user; every file access made for a user runs with the loop
thread's file-system identity switched to that user (``setfsuid``/``setfsgid``, per
thread), so the kernel itself refuses what the user could not do: writing into another
user's folder, following a symlink planted there, reading another user's files. What
the daemon creates there belongs to the user.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from sidecar.ingest.peers import Peer

_libc = ctypes.CDLL(None, use_errno=True)


class ForeignFolder(Exception):
    """A user's folder cannot be used: it is not a real folder owned by that user."""


@contextlib.contextmanager
def acting_as(uid: int, gid: int) -> Iterator[None]:
    """Within the block, this thread's file accesses are checked as ``uid``/``gid`` and
    what it creates belongs to them; other threads keep their identity. Nests.

    Raises PermissionError when the identity cannot be taken (needs CAP_SETUID and
    CAP_SETGID; a daemon that is not root cannot serve other users).
    """
    old_gid = _libc.setfsgid(gid)
    old_uid = _libc.setfsuid(uid)
    try:
        # setfsuid reports no error; asking with an invalid id returns the current one
        if _libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != gid:
            raise PermissionError(
                f"cannot act as uid {uid} gid {gid}: the daemon needs "
                "CAP_SETUID and CAP_SETGID (run it as root)"
            )
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)


def user_folder(root: Path, peer: Peer) -> Path:
    """``root/<user>``, created 0700 and owned by the user if missing; returns it. Call it
    as root (not inside ``acting_as``).

    Raises ForeignFolder when it exists but is not a folder of that user's (a symlink,
    a file, someone else's folder), OSError when it cannot be created.
    """
    folder = root / peer.name
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(folder, 0o700)  # before chown: afterwards only the owner may
        os.chown(folder, peer.uid, peer.gid)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != peer.uid:
        raise ForeignFolder(
            f"{folder} is not a folder owned by {peer.name}; the daemon "
            "will not write there (remove it)"
        )
    return folder
