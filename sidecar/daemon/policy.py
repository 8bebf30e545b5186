"""Where a sidecar may write: a job's own sidecar writes where its job says (relative to
the job's working folder); the node daemon only under its ``--root``; a shared node
daemon only under ``--root/<user>/`` of the user the kernel names for the connection.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.ingest.peers import Peer
from sidecar.ingest.streams import Refused


class OutDirPolicy:
    """Places run folders; ``root`` None is a job's own sidecar; ``shared``: each user
    writes under ``root/<user>``."""

    def __init__(self, root: Path | None, shared: bool = False) -> None:
        self.root = root
        self.shared = shared

    def base(self, owner: Peer | None) -> Path:
        """The folder a run of ``owner`` must lie in (resolved). Raises Refused on a
        shared daemon when the user is unknown (no peer credentials)."""
        assert self.root is not None
        root = self.root.resolve()
        if not self.shared:
            return root
        if owner is None:
            raise Refused("a shared daemon serves only ipc clients whose user the kernel "
                          "names; connect through its ipc socket")
        return root / owner.name

    def resolve(self, out_dir: str, cwd: str, owner: Peer | None = None) -> Path:
        """The absolute run folder for a hello's ``out_dir`` and ``cwd`` from ``owner``.

        Raises Refused when it cannot be resolved or lies outside the daemon's root, or
        on a shared daemon outside the user's own folder (symlinks and '..' followed).
        """
        path = Path(out_dir)
        if self.root is None:
            return (Path(cwd) / path).resolve()
        base = self.base(owner)
        try:
            resolved = (base / path).resolve()
        except (OSError, ValueError) as exc:
            raise Refused(f"out_dir {out_dir!r} cannot be resolved: {exc}") from None
        if resolved.is_relative_to(base):
            return resolved
        root = self.root.resolve()
        if self.shared and resolved.is_relative_to(root):
            raise Refused(f"out_dir {out_dir!r} lies in another user's folder "
                          f"({resolved.relative_to(root).parts[0]}); the runs of "
                          f"{base.name} go under {base}")
        raise Refused(f"out_dir {out_dir!r} lies outside the daemon's root {base}")

    def refusal(self, folder: Path, owner: Peer | None = None) -> str | None:
        """Why ``folder`` may not be written now for ``owner`` (a symlink put there since
        the run started points outside the root or the user's folder), or None."""
        if self.root is None:
            return None
        try:
            base = self.base(owner)
        except Refused as exc:
            return str(exc)
        if folder.resolve().is_relative_to(base):
            return None
        return f"{folder} now lies outside {base}; nothing written"
