"""The ``sidecar`` command line (SPEC §2): run, serve, status."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from markers import endpoints, wire
from sidecar.daemon.server import DEFAULT_NICE, Config, serve
from sidecar.resources.samplers import DEFAULT_INTERVAL_S, MIN_INTERVAL_S

STATUS_TIMEOUT_S = 5.0  # a busy daemon answers after the messages queued before


def _interval_s(text: str) -> float:
    value = float(text)
    if value < MIN_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"{value:g} s is below {MIN_INTERVAL_S:g} s: NVML utilization is averaged over "
            "1/6-1 s, faster polling repeats values")
    return value


def _interval(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=_interval_s, default=DEFAULT_INTERVAL_S,
                        help=f"resource sampling period in seconds (default "
                        f"{DEFAULT_INTERVAL_S:g}, minimum {MIN_INTERVAL_S:g})")
    parser.add_argument("--nice", type=int, default=DEFAULT_NICE, metavar="N",
                        help=f"lower the sidecar's CPU priority by N (default {DEFAULT_NICE}; "
                        "0 keeps the job's): it never competes with training for a core")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sidecar", description="The monitor's sidecar process: receives the markers' "
        "records, samples GPUs and the job's processes, writes computational.tsv, "
        "summary.log and more. See README.md.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run CMD under a sidecar, write files when it ends")
    run.add_argument("--endpoint", help="ipc:// or tcp:// address (default: a private ipc "
                     "socket)")
    _interval(run)
    run.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    srv = commands.add_parser("serve", help="long-running daemon for many jobs")
    srv.add_argument("--endpoint", help=f"ipc:// or tcp:// (default: "
                     f"{endpoints.daemon_endpoint()})")
    srv.add_argument("--root", type=Path, help="write only under this folder (required "
                     "unless --owner-pid is given)")
    srv.add_argument("--owner-pid", type=int, help=argparse.SUPPRESS)
    _interval(srv)
    srv.add_argument("--quiet", action="store_true", help="log warnings and errors only")

    status = commands.add_parser("status", help="live view of a running sidecar")
    status.add_argument("--endpoint", help="default: the daemon's endpoint")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _status(endpoint: str, as_json: bool) -> int:
    from markers.transport import Sender  # the client side of the same wire

    sender = Sender(endpoints.connect_address(endpoint), b"\0" * 16, 0)
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


def main(argv: list[str] | None = None, **seams: Any) -> int:
    """Entry point of the console script and of ``python -m sidecar``; returns the status.
    ``seams`` go to the server (see ``sidecar.daemon.server.Server``); tests use them."""
    args = _parser().parse_args(argv)
    if args.command == "status":
        return _status(args.endpoint or endpoints.daemon_endpoint(), args.json)
    logging.basicConfig(format="sidecar[%(process)d] %(levelname)s: %(message)s",
                        level=logging.WARNING if args.quiet else logging.INFO)
    if args.command == "serve":
        if args.root is None and args.owner_pid is None:
            print("sidecar serve: --root DIR is required", file=sys.stderr)
            return 2
        config = Config(args.endpoint or endpoints.daemon_endpoint(), args.root,
                        args.owner_pid, args.interval, args.nice)
        return serve(config, **seams)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print("sidecar run: give the command after --", file=sys.stderr)
        return 2
    if args.endpoint:
        return serve(Config(args.endpoint, interval_s=args.interval, nice=args.nice), command,
                     **seams)
    endpoint = endpoints.private_endpoint()
    try:
        return serve(Config(endpoint, interval_s=args.interval, nice=args.nice), command,
                     **seams)
    finally:  # the job's private folder (its socket file is already gone)
        socket_file = endpoints.ipc_path(endpoint)
        with contextlib.suppress(OSError):
            if socket_file is not None:
                socket_file.parent.rmdir()
