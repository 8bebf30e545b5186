"""The entry point of the ``sidecar`` command line: parse, then the subcommand's handler
(docs/contract.md, Command line)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from markers import endpoints
from sidecar.cli.clients import ask, finish_command, status_command
from sidecar.cli.parsers import USAGE_ERROR, build_parser
from sidecar.cli.reports import report_command
from sidecar.cli.serving import in_runtime_folder, metrics_viewers, serve_command
from sidecar.ingest.binding import EndpointError
from sidecar.views import commands as view_commands


def _asked_endpoint(args: argparse.Namespace) -> str:
    """The sidecar a client command asks: --endpoint, $SIDECAR_ENDPOINT, the daemon's."""
    return (
        args.endpoint
        or os.environ.get("SIDECAR_ENDPOINT")
        or in_runtime_folder(endpoints.daemon_endpoint)
    )


def main(argv: list[str] | None = None, **seams: Any) -> int:
    """Entry point of the console script and of ``python -m sidecar``; returns the status:
    the job's under ``sidecar run``, 2 for a command-line mistake (one line on stderr).
    ``seams`` go to the server (see ``sidecar.daemon.server.Server``); tests use them."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("status", "finish"):
            endpoint = _asked_endpoint(args)
            if args.command == "finish":
                return finish_command(endpoint, args.job)
            return status_command(endpoint, args.job, args.json)
        if args.command == "report":
            return report_command(args)
        if args.command in view_commands.COMMANDS:
            return view_commands.main(args, ask, lambda: _asked_endpoint(args))
        logging.basicConfig(
            format="sidecar[%(process)d] %(levelname)s: %(message)s",
            level=logging.WARNING if args.quiet else logging.INFO,
        )
        if args.metrics_port is not None:
            from sidecar.daemon.metrics import MetricsExporter  # prometheus_client: only here

            viewers = metrics_viewers(args)
            if viewers is None:
                return USAGE_ERROR
            exporter = MetricsExporter(args.metrics_port, args.metrics_addr, viewers)
            seams["hooks"] = [*seams.get("hooks", ()), exporter]
            seams["viewers"] = viewers
        return serve_command(args, seams)
    except EndpointError as exc:
        print(f"sidecar {args.command}: {exc}", file=sys.stderr)
    return USAGE_ERROR
