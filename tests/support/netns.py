"""Hosts for tests that cross a network: network namespaces joined by a veth pair, each
command run in its own UTS namespace with the node's hostname. Needs root and iproute2.

Addresses (10.77.0.0/24) exist only inside the namespaces made here, which are deleted on
exit; nothing is sent anywhere else. Files are shared: the nodes see one filesystem, as
nodes of a cluster see one shared folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SUBNET_PREFIX = "10.77.0."


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip`` or ``unshare``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [name for name in ("ip", "unshare") if shutil.which(name) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


@dataclass(frozen=True)
class Node:
    """One namespace: its name, hostname, veth interface and address."""

    namespace: str
    hostname: str
    interface: str
    address: str

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside this node: its namespace, its hostname."""
        script = f'hostname {self.hostname} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
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
