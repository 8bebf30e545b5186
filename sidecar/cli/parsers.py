"""The ``sidecar`` command line's parser: each subcommand's arguments, their types
checked as they are read, and mistakes answered on one line with exit status 2."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import NoReturn

from markers import endpoints
from markers import secret as shared_secret
from sidecar import exports
from sidecar.daemon.nodes_wait import DEFAULT_NODES_WAIT_S
from sidecar.daemon.server import DEFAULT_NICE
from sidecar.exports.export_worker import LIVE_S
from sidecar.ingest.receiver import HEARTBEAT_S
from sidecar.resources.samplers import DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from sidecar.views import commands as view_commands

DEFAULT_METRICS_ADDR = "127.0.0.1"
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


def _period_s(text: str) -> float:
    """A period in seconds, 0 or more (0: off)."""
    value = _seconds(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative: give 0 or more seconds")
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
            "1/6-1 s, faster polling repeats values"
        )
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval",
        type=_interval_s,
        default=DEFAULT_INTERVAL_S,
        help=f"resource sampling period in seconds (default "
        f"{DEFAULT_INTERVAL_S:g}, minimum {MIN_INTERVAL_S:g})",
    )
    parser.add_argument(
        "--heartbeat",
        type=_heartbeat_s,
        default=HEARTBEAT_S,
        metavar="SECONDS",
        help="a client that stops answering ZeroMQ "
        "heartbeats (a dead or unreachable host) is dropped, and its run "
        f"written as incomplete, within this time (default {HEARTBEAT_S:g})",
    )
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    parser.add_argument(
        "--nodes-wait",
        type=_seconds,
        default=DEFAULT_NODES_WAIT_S,
        metavar="SECONDS",
        help="serving rank 0 of a job whose other ranks "
        "other sidecars serve (other nodes): wait up to this long at its end "
        "for their final figures before the summary is written for good "
        f"(default {DEFAULT_NODES_WAIT_S:g}; docs/multi-node.md)",
    )
    parser.add_argument(
        "--export",
        type=exports.parse_list,
        default=[],
        metavar="NAMES",
        help="also write each run's figures, step-aligned, to these tools "
        f"(comma-separated: {', '.join(exports.EXPORTERS)}); a run's start_run(export=) "
        "chooses for itself (docs/exports.md)",
    )
    parser.add_argument(
        "--export-every",
        type=_period_s,
        default=LIVE_S,
        metavar="SECONDS",
        help="while a run trains, export its new points this often "
        f"(default {LIVE_S:g}; 0: only at checkpoints and the end)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=DEFAULT_NICE,
        metavar="N",
        help=f"lower the sidecar's CPU priority by N (default {DEFAULT_NICE}; "
        "0 keeps the job's): it never competes with training for a core",
    )


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return value


def _duration(text: str) -> str:
    if not re.fullmatch(r"(\d+(ms|s|m|h|d|w|y))+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30m, 6h or 7d")
    return text


def _metrics(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=_port,
        help="serve Prometheus /metrics on this port (0: any free one)",
    )
    parser.add_argument(
        "--metrics-addr",
        default=DEFAULT_METRICS_ADDR,
        help=f"address /metrics binds to (default {DEFAULT_METRICS_ADDR}: this host only)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of the whole command line, one subparser per subcommand."""
    parser = _Parser(
        prog="sidecar",
        description="The monitor's sidecar process: receives the markers' "
        "records, samples GPUs and the job's processes, writes computational.tsv, "
        "summary.log and more. See README.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run CMD under a sidecar, write files when it ends")
    run.add_argument(
        "--endpoint",
        type=_endpoint,
        help="ipc:// or tcp:// address (default: "
        "a private ipc socket); only the job, which gets a secret in "
        f"{shared_secret.ENV}, is served",
    )
    _common(run)
    _metrics(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    srv = commands.add_parser("serve", help="long-running daemon for many jobs")
    srv.add_argument(
        "--endpoint",
        type=_endpoint,
        help="ipc:// or tcp:// (default: "
        "$XDG_RUNTIME_DIR/sidecar/sidecar.sock, else /tmp/sidecar-UID/sidecar.sock)",
    )
    srv.add_argument("--root", type=Path, help="required: write run folders only under this folder")
    # The private sidecar that start_run launches for a plain `python train.py`.
    srv.add_argument("--owner-pid", type=int, help=argparse.SUPPRESS)
    srv.add_argument(
        "--shared",
        action="store_true",
        help="one daemon for every local user "
        "(run as root, ipc endpoint): the kernel names each connection's user, "
        "whose runs go under ROOT/<user>/, written as that user",
    )
    _common(srv)
    _metrics(srv)
    srv.add_argument(
        "--allow",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="with --shared, repeatable: a job's own folder under DIR is "
        "written in place, as the job's user (else under ROOT/<user>/)",
    )
    srv.add_argument(
        "--metrics-token-file",
        type=Path,
        help="with --shared: a scrape "
        "showing the token in this file (Authorization: Bearer) sees every "
        "run; others see the node-wide figures, or their own runs with the "
        "token in ROOT/<user>/.metrics-token",
    )

    default = "default: $SIDECAR_ENDPOINT, else the daemon's endpoint"
    status = commands.add_parser("status", help="live view of a running sidecar")
    status.add_argument(
        "--endpoint",
        type=_endpoint,
        help=f"{default} (a job's own sidecar needs its {shared_secret.ENV})",
    )
    status.add_argument("--job", help="show only the runs of this Slurm job id")
    status.add_argument("--json", action="store_true", help="print one JSON object")

    finish = commands.add_parser("finish", help="end a Slurm job's runs now (the epilog)")
    finish.add_argument("--job", required=True, help="the Slurm job id")
    finish.add_argument("--endpoint", type=_endpoint, help=default)
    report = commands.add_parser(
        "report", help="cluster-wide GPU report from run folders or a Prometheus server"
    )
    report.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="PATH",
        help="run folders, or folders holding them at any depth",
    )
    report.add_argument(
        "--out",
        type=Path,
        default=Path("report"),
        help="folder for jobs.tsv, gpus.tsv, summary.tsv, report.md and "
        "report.html (default ./report)",
    )
    report.add_argument("--html", type=Path, help="write the page here instead")
    report.add_argument(
        "--prometheus",
        metavar="URL",
        help="build the report from this Prometheus server's series instead of run folders",
    )
    report.add_argument(
        "--since",
        metavar="DURATION",
        type=_duration,
        help="with --prometheus: the runs with series in this last span (30m, 6h, 7d, ...)",
    )
    report.add_argument(
        "--job",
        metavar="ID|FOLDER",
        help="one job's efficiency on the "
        "terminal: a run folder, or a Slurm job id searched under PATH "
        "(default .)",
    )
    report.add_argument("--json", action="store_true", help="with --job: the figures as JSON")
    report.add_argument(
        "--into-folder",
        action="store_true",
        help="with --job: also write it into the job's folder (efficiency.txt, or efficiency.json)",
    )
    view_commands.add_commands(commands, _endpoint)  # top, trace, compare
    return parser
