"""Where a sidecar may write: a job's own sidecar writes where its job says (relative to
the job's working folder); the node daemon only under its ``--root``.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.ingest.streams import Refused


class OutDirPolicy:
    """Places run folders; ``root`` None is a job's own sidecar."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def resolve(self, out_dir: str, cwd: str) -> Path:
        """The absolute run folder for a hello's ``out_dir`` and ``cwd``.

        Raises Refused when it cannot be resolved or lies outside the daemon's root
        (symlinks and '..' followed).
        """
        path = Path(out_dir)
        if self.root is None:
            return (Path(cwd) / path).resolve()
        root = self.root.resolve()
        try:
            resolved = (root / path).resolve()
        except (OSError, ValueError) as exc:
            raise Refused(f"out_dir {out_dir!r} cannot be resolved: {exc}") from None
        if not resolved.is_relative_to(root):
            raise Refused(f"out_dir {out_dir!r} lies outside the daemon's root {root}")
        return resolved

    def refusal(self, folder: Path) -> str | None:
        """Why ``folder`` may not be written now (a symlink put there since the run started
        points outside the root), or None."""
        if self.root is None or folder.resolve().is_relative_to(self.root.resolve()):
            return None
        return f"{folder} now lies outside the daemon's root {self.root}; nothing written"
