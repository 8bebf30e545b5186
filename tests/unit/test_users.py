"""The peer credentials libzmq reports for an ipc connection (``sidecar.ingest.peers``: a
real client forked under another uid; a hand-made handshake that tries to forge them) and
the per-thread file identity of a shared daemon (``sidecar.daemon.users``). Needs root
(skipped otherwise).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from pathlib import Path

import pytest
import zmq

from sidecar.daemon.users import ForeignFolder, acting_as, user_folder
from sidecar.ingest.peers import Peer, peer_of

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (other uids)")


def _router(folder: Path) -> tuple[zmq.Socket, str]:
    folder.chmod(0o755)  # reachable by the other uid (short_tmp lies in /tmp)
    socket_file = folder / "s.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 10_000)
    router.bind(f"ipc://{socket_file}")
    socket_file.chmod(0o666)
    return router, str(socket_file)


def test_peer_is_the_kernels_uid_gid_pid_of_the_connecting_process(short_tmp: Path) -> None:
    router, path = _router(short_tmp)
    child = os.fork()
    if child == 0:  # the client, as nobody
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            client = zmq.Context().socket(zmq.DEALER)
            client.setsockopt(zmq.LINGER, 0)
            client.setsockopt(zmq.RCVTIMEO, 10_000)
            client.connect(f"ipc://{path}")
            client.send(b"hi")
            client.recv()  # the reply: the message was read
        finally:
            os._exit(0)
    try:
        identity, frame = router.recv_multipart(copy=False)
        assert peer_of(frame) == Peer(NOBODY, NOBODY, child)
        router.send_multipart([identity.bytes, b"ok"])
    finally:
        os.waitpid(child, 0)
        router.close()


def test_a_peer_cannot_claim_other_credentials_in_its_handshake(short_tmp: Path) -> None:
    router, path = _router(short_tmp)
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(path)

    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    # ZMTP 3.0 greeting (NULL mechanism), then READY with forged properties, then "x"
    raw.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
    raw.settimeout(10)
    greeting = b""
    while len(greeting) < 64:  # libzmq may miss a READY sent before its greeting went out
        greeting += raw.recv(64 - len(greeting))
    ready = (
        b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Peer-Address", b"evil:4242:4242:1")
    )
    raw.sendall(bytes([0x04, len(ready)]) + ready + b"\x00\x01x")
    try:
        _, frame = router.recv_multipart(copy=False)
        assert peer_of(frame) == Peer(os.getuid(), os.getgid(), os.getpid())
    finally:
        raw.close()
        router.close()


def test_acting_as_a_user_is_per_thread_and_the_kernel_enforces_it(short_tmp: Path) -> None:
    short_tmp.chmod(0o755)
    private = short_tmp / "root-only"
    private.mkdir(mode=0o700)
    theirs = short_tmp / "nobody"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    inside = threading.Event()
    leave = threading.Event()
    other_thread: list[str] = []

    def root_thread() -> None:
        inside.wait(10)
        (private / "root-file").write_text("root")  # this thread is still root
        other_thread.append("wrote")
        leave.set()

    helper = threading.Thread(target=root_thread)
    helper.start()
    with acting_as(NOBODY, NOBODY):
        (theirs / "made").write_text("x")
        with pytest.raises(PermissionError):
            (private / "denied").write_text("x")
        inside.set()
        leave.wait(10)
    helper.join()
    assert other_thread == ["wrote"]
    assert (theirs / "made").stat().st_uid == NOBODY
    (private / "again").write_text("root again")  # back to root after the block


def test_user_folder_is_private_and_owned_and_refuses_a_planted_one(short_tmp: Path) -> None:
    peer = Peer(NOBODY, NOBODY, 1)
    folder = user_folder(short_tmp, peer)
    info = folder.stat()
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (NOBODY, NOBODY, 0o700)
    assert user_folder(short_tmp, peer) == folder  # idempotent
    folder.rmdir()
    (short_tmp / "elsewhere").mkdir()
    folder.symlink_to(short_tmp / "elsewhere")
    with pytest.raises(ForeignFolder, match="not a folder owned by"):
        user_folder(short_tmp, peer)
