"""The ``sidecar`` command line (SPEC §2): run, serve, status."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from markers import endpoints, wire
from markers import secret as shared_secret
from sidecar.daemon.server import Config, serve
from sidecar.ingest.receiver import HEARTBEAT_S, EndpointError
from sidecar.resources.samplers import DEFAULT_INTERVAL_S, MIN_INTERVAL_S

STATUS_TIMEOUT_S = 5.0  # a busy daemon answers after the messages queued before
USAGE_ERROR = 2  # the exit status of a command-line mistake


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are one line (what, and where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line and exit with status 2."""
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of seconds")
    return value


def _heartbeat_s(text: str) -> float:
    value = _seconds(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{value:g} s: give 0.1 to 3600 seconds")
    return value


def _endpoint(text: str) -> str:
    try:
        return endpoints.check(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _interval_s(text: str) -> float:
    value = _seconds(text)
    if value < MIN_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"{value:g} s is below {MIN_INTERVAL_S:g} s: NVML utilization is averaged over "
            "1/6-1 s, faster polling repeats values")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=_interval_s, default=DEFAULT_INTERVAL_S,
                        help=f"resource sampling period in seconds (default "
                        f"{DEFAULT_INTERVAL_S:g}, minimum {MIN_INTERVAL_S:g})")
    parser.add_argument("--heartbeat", type=_heartbeat_s, default=HEARTBEAT_S,
                        metavar="SECONDS", help="a client that stops answering ZeroMQ "
                        "heartbeats (a dead or unreachable host) is dropped, and its run "
                        f"written as incomplete, within this time (default {HEARTBEAT_S:g})")
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sidecar", description="The monitor's sidecar process: receives the markers' "
        "records, samples GPUs and the job's processes, writes computational.tsv, "
        "summary.log and more. See README.md.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run CMD under a sidecar, write files when it ends")
    run.add_argument("--endpoint", type=_endpoint, help="ipc:// or tcp:// address (default: "
                     "a private ipc socket); only the job, which gets a secret in "
                     f"{shared_secret.ENV}, is served")
    _common(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    srv = commands.add_parser("serve", help="long-running daemon for many jobs")
    srv.add_argument("--endpoint", type=_endpoint, help="ipc:// or tcp:// (default: "
                     "$XDG_RUNTIME_DIR/sidecar/sidecar.sock, else /tmp/sidecar-UID/sidecar.sock)")
    srv.add_argument("--root", type=Path, help="required: write run folders only under this "
                     "folder")
    # The private sidecar that start_run launches for a plain `python train.py`.
    srv.add_argument("--owner-pid", type=int, help=argparse.SUPPRESS)
    _common(srv)

    status = commands.add_parser("status", help="live view of a running sidecar")
    status.add_argument("--endpoint", type=_endpoint, help="default: the daemon's endpoint "
                        f"(a job's own sidecar needs its {shared_secret.ENV})")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _status(endpoint: str, as_json: bool) -> int:
    from markers.transport import Sender  # the client side of the same wire

    socket_file = endpoints.ipc_path(endpoint)
    if socket_file is not None and not socket_file.exists():
        print(f"sidecar status: no sidecar at {endpoint} (its socket file does not exist)",
              file=sys.stderr)
        return 1
    sender = Sender(endpoints.connect_address(endpoint), b"\0" * 16, 0,
                    os.environ.get(shared_secret.ENV))
    try:
        reply = sender.request({"type": wire.STATUS}, STATUS_TIMEOUT_S,
                               connect_timeout_s=STATUS_TIMEOUT_S)
    finally:
        sender.close()
    if reply is None:
        print(f"sidecar status: no sidecar answered at {endpoint} within "
              f"{STATUS_TIMEOUT_S:.0f} s", file=sys.stderr)
        return 1
    reply.pop("reply_to", None)
    reply.pop("ok", None)
    if as_json:
        print(json.dumps(reply))
        return 0
    samplers = reply["samplers"]
    print(f"sidecar pid {reply['pid']} on {reply['endpoint']}; sampling every "
          f"{samplers['interval_s']:g} s: host {samplers['host']}, GPU {samplers['gpu']}")
    print(f"records {reply['records']} ({reply['records_per_s']:.0f}/s), dropped "
          f"{reply['dropped']}, lost {reply['lost']}, rejected {reply['rejected']} "
          f"{reply['rejected_by_kind'] or ''}".rstrip())
    if reply.get("last_error"):
        print(f"last error: {reply['last_error']}")
    for run in reply["runs"]:
        print(f"  run {run['run_id'][:8]} split {run['split']} rank {run['rank']} "
              f"pid {run['pid']} {run['status']}: {run['records']} records -> {run['out_dir']}"
              + (f" (write error: {run['write_error']})" if run["write_error"] else ""))
    return 0


def _remove_private_folder(endpoint: str) -> None:
    """Remove the private folder of a job's socket (``job-*``, made by
    ``endpoints.private_endpoint``) once empty: its socket file is gone by now."""
    socket_file = endpoints.ipc_path(endpoint)
    if socket_file is not None and socket_file.parent.name.startswith("job-"):
        with contextlib.suppress(OSError):  # not empty, or already gone: leave it
            socket_file.parent.rmdir()


def _serve(args: argparse.Namespace, seams: dict[str, Any]) -> int:
    if args.command == "serve":
        if args.root is None and args.owner_pid is None:
            print("sidecar serve: --root DIR is required", file=sys.stderr)
            return USAGE_ERROR
        config = Config(args.endpoint or endpoints.daemon_endpoint(), args.root,
                        args.owner_pid, args.interval, os.environ.get(shared_secret.ENV),
                        args.heartbeat)
        try:
            return serve(config, **seams)
        finally:
            if args.owner_pid is not None:  # a private sidecar, whose owner may be dead
                _remove_private_folder(config.endpoint)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("sidecar run: give the command after --", file=sys.stderr)
        return USAGE_ERROR
    endpoint = args.endpoint or endpoints.private_endpoint()
    try:
        return serve(Config(endpoint, interval_s=args.interval, secret=shared_secret.new(),
                            heartbeat_s=args.heartbeat), command, **seams)
    finally:
        if args.endpoint is None:
            _remove_private_folder(endpoint)


def main(argv: list[str] | None = None, **seams: Any) -> int:
    """Entry point of the console script and of ``python -m sidecar``; returns the status:
    the job's under ``sidecar run``, 2 for a command-line mistake (one line on stderr).
    ``seams`` go to the server (see ``sidecar.daemon.server.Server``); tests use them."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "status":
            return _status(args.endpoint or endpoints.daemon_endpoint(), args.json)
        logging.basicConfig(format="sidecar[%(process)d] %(levelname)s: %(message)s",
                            level=logging.WARNING if args.quiet else logging.INFO)
        return _serve(args, seams)
    except EndpointError as exc:
        print(f"sidecar {args.command}: {exc}", file=sys.stderr)
    except (OSError, endpoints.UnsafeFolder) as exc:  # the runtime folder
        print(f"sidecar {args.command}: cannot use the runtime folder: {exc}; set "
              "XDG_RUNTIME_DIR to a folder of yours, or give --endpoint", file=sys.stderr)
    return USAGE_ERROR
