"""Users kept apart on a shared node daemon (SPEC §5 "another user's folder", §8).

Who sent a message is what the kernel says, never what the message claims. libzmq takes
the peer credentials of every ipc connection (``SO_PEERCRED``) when it accepts it and
hands them out with each message as the ``Peer-Address`` property, ``host:uid:gid:pid``;
a peer cannot override it (its handshake metadata never replaces that property; the
``User-Id`` property, in contrast, can be sent by the peer and is not used).
``tests/unit/test_users.py`` checks both against a real forked client and a hand-made
handshake.

A shared daemon runs as root. Each user's runs go under ``ROOT/<user>/``, a folder
created 0700 and owned by that user; every file access made for a user's messages runs
with the thread's file-system identity switched to that user (``setfsuid``/``setfsgid``,
per thread), so the kernel itself refuses what the user could not do: writing into
another user's folder, following a symlink planted there, reading another user's files.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq

_libc = ctypes.CDLL(None, use_errno=True)


class ForeignFolder(Exception):
    """A user's folder cannot be used: it is not a real folder owned by that user."""


@dataclass(frozen=True)
class Peer:
    """The kernel's credentials of a client connection (at the time it connected)."""

    uid: int
    gid: int
    pid: int

    @property
    def name(self) -> str:
        """The user's login name; the uid as text when the system does not know it."""
        return user_name(self.uid)


def peer_of(frame: zmq.Frame) -> Peer | None:
    """The credentials of the ipc connection ``frame`` came on; None when libzmq gives
    none (only call it for messages read from an ipc socket: a tcp peer address has
    another form).
    """
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    parts = address.rsplit(":", 3) if isinstance(address, str) else []
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(int(parts[1]), int(parts[2]), int(parts[3]))


def user_name(uid: int) -> str:
    """The login name of ``uid``, or the uid as text when it has no passwd entry."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


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
            raise PermissionError(f"cannot act as uid {uid} gid {gid}: the daemon needs "
                                  "CAP_SETUID and CAP_SETGID (run it as root)")
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)


def user_folder(root: Path, peer: Peer) -> Path:
    """``root/<user>``, created 0700 and owned by the user if missing; returns it.

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
        raise ForeignFolder(f"{folder} is not a folder owned by {peer.name}; the daemon "
                            "will not write there (remove it)")
    return folder
