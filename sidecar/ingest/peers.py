"""Who sent a message, as the kernel says (docs/contract.md, Faults and bad input and Node daemon):
never what the message claims.

libzmq takes the peer credentials of every ipc connection (``SO_PEERCRED``) when it
accepts it and hands them out with each message as the ``Peer-Address`` property,
``host:uid:gid:pid``. A peer cannot override it: its handshake metadata never replaces
that property (the ``User-Id`` property, in contrast, can be sent by the peer and is not
used). ``tests/unit/test_users.py`` checks both, with a real client forked under another
uid and a hand-made handshake.
"""

from __future__ import annotations

import functools
import pwd
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class Peer:
    """The kernel's credentials of a client connection (at the time it connected); the
    pid is in the daemon's pid namespace."""

    uid: int
    gid: int
    pid: int

    @property
    def name(self) -> str:
        """The user's login name; the uid as text when the system does not know it."""
        return user_name(self.uid)


@functools.lru_cache(maxsize=4096)
def user_name(uid: int) -> str:
    """The login name of ``uid``, or the uid as text when the system does not know it.
    Cached: the status view names every run's user at each loop turn, and a directory
    service lookup can be slow."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def peer_of(frame: zmq.Frame) -> Peer | None:
    """The credentials of the ipc connection ``frame`` came on; None when libzmq gives
    none. Only for messages read from an ipc socket: a tcp peer address has another form
    (an IPv6 address could even parse).
    """
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    parts = address.rsplit(":", 3) if isinstance(address, str) else []
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(int(parts[1]), int(parts[2]), int(parts[3]))
