"""``sidecar serve`` and ``sidecar run``: their command line checked, the server's
Config made from it, the private socket folder removed after."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from markers import endpoints
from markers import secret as shared_secret
from sidecar import exports
from sidecar.cli.parsers import USAGE_ERROR
from sidecar.daemon.notify import SystemdNotifier, stall_s_for
from sidecar.daemon.server import Config, serve
from sidecar.daemon.viewers import Viewers, read_token
from sidecar.ingest.binding import EndpointError


def _serve_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a ``serve`` command line (one line), or None."""
    if args.root is None and args.owner_pid is None:
        return "--root DIR is required"
    if args.shared:
        if args.root is None:
            return "--shared needs --root DIR"
        if os.geteuid() != 0:
            return "--shared must run as root: it writes each user's runs as that user"
        if args.endpoint is None or endpoints.ipc_path(args.endpoint) is None:
            return (
                "--shared needs an ipc:// --endpoint (the kernel names the user of an ipc "
                "connection only), e.g. ipc:///run/sidecar/sidecar.sock"
            )
    for folder in args.allow:
        if not args.shared:
            return "--allow needs --shared"
        if not folder.is_absolute() or not folder.is_dir() or len(folder.resolve().parts) < 2:
            return f"--allow {folder}: give an absolute path of an existing folder, not /"
    return None


def metrics_viewers(args: argparse.Namespace) -> Viewers | None:
    """Who sees which runs in /metrics; None, after one line on stderr, when the admin's
    token file cannot be read."""
    shared = getattr(args, "shared", False)
    token_file = getattr(args, "metrics_token_file", None)
    if token_file is None:
        return Viewers(shared)
    try:
        return Viewers(shared, read_token(token_file))
    except (OSError, ValueError) as exc:
        print(f"sidecar {args.command}: cannot read --metrics-token-file: {exc}", file=sys.stderr)
        return None


def in_runtime_folder(make: Callable[[], str]) -> str:
    """A default endpoint, made in the runtime folder; EndpointError (one line) when that
    folder cannot be used."""
    try:
        return make()
    except (OSError, endpoints.UnsafeFolder) as exc:
        raise EndpointError(
            f"cannot use the runtime folder: {exc}; set XDG_RUNTIME_DIR to "
            "a folder of yours, or give --endpoint"
        ) from None


def _remove_private_folder(endpoint: str) -> None:
    """Remove the private folder of a job's socket (``job-*``, made by
    ``endpoints.private_endpoint``) once empty: its socket file is gone by now."""
    socket_file = endpoints.ipc_path(endpoint)
    if socket_file is not None and socket_file.parent.name.startswith("job-"):
        with contextlib.suppress(OSError):  # not empty, or already gone: leave it
            socket_file.parent.rmdir()


def _exports(names: list[str]) -> tuple[str, ...]:
    """The usable ``--export`` names; one warning for the others (the sidecar goes on)."""
    usable, warning = exports.choose(names)
    if warning:
        logging.getLogger("sidecar").warning("--export: %s", warning)
    return usable


def serve_command(args: argparse.Namespace, seams: dict[str, Any]) -> int:
    """``sidecar serve`` and ``sidecar run``: serve until stopped (``run``: until its job
    ended); the job's exit status under ``run``, 2 for a command-line mistake. ``seams``
    go to the server."""
    if args.command == "serve":
        problem = _serve_problem(args)
        if problem:
            print(f"sidecar serve: {problem}", file=sys.stderr)
            return USAGE_ERROR
        if args.shared:  # root's supplementary groups must not open users' files
            os.setgroups([])
        config = Config(
            args.endpoint or in_runtime_folder(endpoints.daemon_endpoint),
            args.root,
            args.owner_pid,
            args.interval,
            secret=os.environ.get(shared_secret.ENV),
            heartbeat_s=args.heartbeat,
            shared=args.shared,
            nice=args.nice,
            nodes_wait_s=args.nodes_wait,
            allowed=tuple(args.allow),
            export=_exports(args.export),
            export_every_s=args.export_every,
        )
        # sd_notify for systemd (Type=notify, watchdog); sends nothing without NOTIFY_SOCKET
        notifier = SystemdNotifier(stall_s_for(args.interval))
        try:
            return serve(config, **{**seams, "hooks": [notifier, *seams.get("hooks", ())]})
        finally:
            if args.owner_pid is not None:  # a private sidecar, whose owner may be dead
                _remove_private_folder(config.endpoint)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("sidecar run: give the command after --", file=sys.stderr)
        return USAGE_ERROR
    endpoint = args.endpoint or in_runtime_folder(endpoints.private_endpoint)
    try:
        return serve(
            Config(
                endpoint,
                interval_s=args.interval,
                secret=shared_secret.new(),
                heartbeat_s=args.heartbeat,
                nice=args.nice,
                nodes_wait_s=args.nodes_wait,
                export=_exports(args.export),
                export_every_s=args.export_every,
            ),
            command,
            **seams,
        )
    finally:
        if args.endpoint is None:
            _remove_private_folder(endpoint)
