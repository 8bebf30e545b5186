"""Where a sidecar may write: a job's own sidecar writes where its job says (relative to
the job's working folder); the node daemon only under its ``--root``. Neither writes a
run folder at an absurd place: the filesystem root or a folder right under it (an
``out_dir`` of ``/////`` or ``/tmp`` would scatter ``run.json`` and ``training/`` there),
the user's home folder itself, or the daemon's root itself.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.ingest.streams import Refused


def absurd(folder: Path, root: Path | None = None) -> str | None:
    """Why the resolved ``folder`` is no place for a run folder, or None."""
    if len(folder.parts) <= 2:
        return "the filesystem root or a folder right under it"
    if folder == Path.home().resolve():
        return "the home folder itself"
    if root is not None and folder == root:
        return "the daemon's root itself"
    return None


class OutDirPolicy:
    """Places run folders; ``root`` None is a job's own sidecar."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def resolve(self, out_dir: str, cwd: str) -> Path:
        """The absolute run folder for a hello's ``out_dir`` and ``cwd``.

        Raises Refused when it cannot be resolved, lies outside the daemon's root
        (symlinks and '..' followed) or at an absurd place (``absurd``).
        """
        root = self.root.resolve() if self.root is not None else None
        try:
            resolved = ((root or Path(cwd)) / out_dir).resolve()
        except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop
            raise Refused(f"out_dir {out_dir!r} cannot be resolved: {exc}") from None
        if root is not None and not resolved.is_relative_to(root):
            raise Refused(f"out_dir {out_dir!r} lies outside the daemon's root {root}")
        reason = absurd(resolved, root)
        if reason:
            raise Refused(f"out_dir {out_dir!r} resolves to {resolved}, {reason}: give a "
                          "folder of its own")
        return resolved

    def refusal(self, folder: Path) -> str | None:
        """Why ``folder`` may not be written now (a symlink put there since the run started
        points outside the root), or None."""
        if self.root is None or folder.resolve().is_relative_to(self.root.resolve()):
            return None
        return f"{folder} now lies outside the daemon's root {self.root}; nothing written"
