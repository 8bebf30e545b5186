"""Hosts for tests that cross a network: network namespaces joined by a veth pair, each
command run in its own UTS namespace with the node's hostname. Needs root and iproute2.

Addresses (10.77.0.0/24) exist only inside the namespaces made here, which are deleted on
exit; nothing is sent anywhere else. Files are shared: the nodes see one filesystem, as
nodes of a cluster see one shared folder.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUBNET_PREFIX = "10.77.0."


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, ``nsenter`` or
    ``unshare``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [name for name in ("ip", "nsenter", "unshare") if shutil.which(name) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


@dataclass(frozen=True)
class Node:
    """One namespace: its name, hostname, veth interface and address; ``binds`` (folder,
    where it appears) are folders of this node alone, as each node has its own /run."""

    namespace: str
    hostname: str
    interface: str
    address: str
    binds: tuple[tuple[Path, Path], ...] = ()

    def with_binds(self, *binds: tuple[Path, Path]) -> Node:
        """This node where each ``(folder, path)`` of ``binds`` shows ``folder`` at
        ``path`` (an existing folder) to the commands run on it, and to them only."""
        return replace(self, binds=self.binds + binds)

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside this node: its namespace, its hostname, its binds (in a
        mount namespace of its own; mounts made there stay there). Entered with
        ``nsenter``, not ``ip netns exec``: that one mounts a fresh sysfs, which hides the
        host's cgroup folders (slurmd refuses to start without them)."""
        mounts = "".join(
            f"mount --bind {shlex.quote(str(folder))} {shlex.quote(str(path))} && "
            for folder, path in self.binds
        )
        script = f'hostname {self.hostname} && {mounts}exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespace}",
            "unshare",
            "--uts",
            *(["--mount"] if self.binds else []),
            "sh",
            "-c",
            script,
            "sh",
            *command,
        ]

    def popen(
        self, command: Sequence[str], env: Mapping[str, str], **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``command`` on this node (gloo told to use the node's interface)."""
        return subprocess.Popen(
            self.argv(command), env={**env, "GLOO_SOCKET_IFNAME": self.interface}, **kwargs
        )


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def nodes(count: int = 2) -> Iterator[list[Node]]:
    """``count`` (2) namespaces joined by one veth pair, named after this process so
    parallel test runs never share them; deleted on exit."""
    if count != 2:
        raise ValueError("a veth pair joins exactly two nodes")
    tag = f"tm{os.getpid() % 100000}"
    made: list[Node] = []
    try:
        for index in range(count):
            node = Node(
                f"{tag}n{index}", f"node{index}", f"{tag}v{index}", f"{SUBNET_PREFIX}{index + 1}"
            )
            _ip("netns", "add", node.namespace)
            made.append(node)
        _ip("link", "add", made[0].interface, "type", "veth", "peer", "name", made[1].interface)
        for node in made:
            _ip("link", "set", node.interface, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
        yield made
    finally:
        for node in made:
            subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True, timeout=30)
