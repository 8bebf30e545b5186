"""Where a sidecar may write: a job's own sidecar writes where its job says (relative to
the job's working folder); the node daemon only under its ``--root``; a shared node
daemon only under ``--root/<user>/`` of the user the kernel names for the connection, or,
with ``--allow DIR``, in the folder the job names when it lies under an allowed root
(resolved and created as the user, so the kernel checks every step; a link that leads out
of the allowed roots is not followed there).
None writes a run folder at an absurd place: the filesystem root or a folder right under
it (an ``out_dir`` of ``/////`` or ``/tmp`` would scatter ``run.json`` and ``training/``
there), the user's home folder itself, or the daemon's root (the user's folder on a
shared daemon) itself.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.ingest.hello_check import Refused
from sidecar.ingest.peers import Peer


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
    """Places run folders; ``root`` None is a job's own sidecar; ``shared``: each user
    writes under ``root/<user>``."""

    def __init__(
        self, root: Path | None, shared: bool = False, allowed: tuple[Path, ...] = ()
    ) -> None:
        self.root = root
        self.shared = shared
        self.allowed = tuple(folder.resolve() for folder in allowed)

    def base(self, owner: Peer | None) -> Path:
        """The folder a run of ``owner`` must lie in (resolved). Raises Refused on a
        shared daemon when the user is unknown (no peer credentials)."""
        assert self.root is not None
        root = self.root.resolve()
        if not self.shared:
            return root
        if owner is None:
            raise Refused(
                "a shared daemon serves only ipc clients whose user the kernel "
                "names; connect through its ipc socket"
            )
        return root / owner.name

    def resolve(self, out_dir: str, cwd: str, owner: Peer | None = None) -> Path:
        """The absolute run folder for a hello's ``out_dir`` and ``cwd`` from ``owner``.

        Raises Refused when it cannot be resolved, lies outside the daemon's root, or on a
        shared daemon outside the user's own folder (symlinks and '..' followed), or at an
        absurd place (``absurd``).
        """
        base = self.base(owner) if self.root is not None else None
        own = self._in_allowed(out_dir, cwd)
        if own is not None:
            return own
        try:
            resolved = ((base or Path(cwd)) / out_dir).resolve()
        except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop
            raise Refused(f"out_dir {out_dir!r} cannot be resolved: {exc}") from None
        if base is not None and not resolved.is_relative_to(base):
            assert self.root is not None
            root = self.root.resolve()
            if self.shared and resolved.is_relative_to(root):
                raise Refused(
                    f"out_dir {out_dir!r} lies in another user's folder "
                    f"({resolved.relative_to(root).parts[0]}); the runs of "
                    f"{base.name} go under {base}"
                )
            raise Refused(f"out_dir {out_dir!r} lies outside the daemon's root {base}")
        reason = absurd(resolved, base)
        if reason:
            raise Refused(
                f"out_dir {out_dir!r} resolves to {resolved}, {reason}: give a folder of its own"
            )
        return resolved

    def _allowed_root(self, folder: Path) -> Path | None:
        return next(
            (root for root in self.allowed if folder.is_relative_to(root) and folder != root), None
        )

    def _in_allowed(self, out_dir: str, cwd: str) -> Path | None:
        """The job's own folder ``cwd/out_dir`` when it lies under an allowed root: made
        (call it as the run's user: the kernel then refuses what the user may not do) and
        resolved again, links followed, still under that root. None when it lies under
        none (the run then goes under the user's folder). Raises Refused when it lies
        under one but cannot be made, or leads out of the allowed roots."""
        if not self.allowed:
            return None
        try:
            asked = (Path(cwd) / out_dir).resolve()
        except (OSError, ValueError, RuntimeError):
            return None  # said by the usual resolution
        if self._allowed_root(asked) is None or absurd(asked):
            return None
        try:
            asked.mkdir(parents=True, exist_ok=True)
            made = asked.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise Refused(
                f"out_dir {asked} cannot be used: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        if self._allowed_root(made) is None:
            raise Refused(
                f"out_dir {asked} leads to {made}, outside the folders this "
                "daemon may write for you"
            )
        return made

    def refusal(self, folder: Path, owner: Peer | None = None) -> str | None:
        """Why ``folder`` may not be written now for ``owner`` (a symlink put there since
        the run started points outside the root or the user's folder), or None."""
        if self.root is None:
            return None
        try:
            base = self.base(owner)
        except Refused as exc:
            return str(exc)
        resolved = folder.resolve()
        if resolved.is_relative_to(base) or self._allowed_root(resolved) is not None:
            return None
        return f"{folder} now lies outside {base}; nothing written"
