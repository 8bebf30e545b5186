"""The ``sidecar`` command line (docs/contract.md, Command line): run, serve, status, finish,
report."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from markers import endpoints, wire
from markers import secret as shared_secret
from sidecar import exports
from sidecar.daemon.nodes_wait import DEFAULT_NODES_WAIT_S
from sidecar.daemon.notify import SystemdNotifier, stall_s_for
from sidecar.daemon.server import DEFAULT_NICE, Config, serve
from sidecar.daemon.viewers import Viewers, read_token
from sidecar.exports.export_worker import LIVE_S
from sidecar.ingest.binding import EndpointError
from sidecar.ingest.receiver import HEARTBEAT_S
from sidecar.resources.samplers import DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from sidecar.views import commands as view_commands

DEFAULT_METRICS_ADDR = "127.0.0.1"
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


def _parser() -> argparse.ArgumentParser:
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


def _job_report(args: argparse.Namespace) -> int:
    """``report --job``: one job's efficiency on stdout (and in its folder)."""
    from sidecar.report import job_efficiency, read
    from sidecar.sinks.atomic import write_atomic

    try:
        folder = job_efficiency.find_job(args.job, args.paths or [Path(".")])
        figures = job_efficiency.figures(folder)
    except (job_efficiency.JobNotFound, read.Damaged) as exc:
        print(f"sidecar report: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(figures, indent=2) if args.json else "\n".join(job_efficiency.render(figures))
    print(text)
    if args.into_folder:
        name = "efficiency.json" if args.json else "efficiency.txt"
        try:
            write_atomic(folder / name, text + "\n")
        except OSError as exc:
            print(f"sidecar report: cannot write {folder / name}: {exc}", file=sys.stderr)
            return 1
    return 0


def _report(args: argparse.Namespace) -> int:
    if args.job:
        return _job_report(args)
    # pandas and numpy: imported only for this command
    from sidecar.report import build
    from sidecar.report.from_prometheus import PrometheusError, from_prometheus
    from sidecar.report.progress import Progress

    if args.prometheus:
        if args.paths or not args.since:
            print(
                "sidecar report: --prometheus URL takes --since DURATION and no PATH",
                file=sys.stderr,
            )
            return 2
        try:
            report = from_prometheus(args.prometheus, args.since)
        except PrometheusError as exc:
            print(f"sidecar report: {exc}", file=sys.stderr)
            return 1
    else:
        missing = [str(p) for p in args.paths if not p.exists()]
        if not args.paths or missing:
            print(
                "sidecar report: "
                + (
                    f"no such folder: {', '.join(missing)}"
                    if missing
                    else "give the folders holding the run folders "
                    "(or --prometheus URL --since DURATION)"
                ),
                file=sys.stderr,
            )
            return 2
        report = build.from_folders(args.paths, Progress("reading run folders").update)
    for folder, reason in report.damaged.itertuples(index=False, name=None):
        print(f"sidecar report: skipped {folder}: {reason}", file=sys.stderr)
    try:
        written = build.write(report, args.out, args.html)
    except OSError as exc:
        print(f"sidecar report: cannot write the report: {exc}", file=sys.stderr)
        return 1
    print(
        f"{len(report.jobs)} jobs, {len(report.damaged)} damaged folders skipped; wrote "
        + ", ".join(str(p) for p in written)
    )
    return 0


def _ask(command: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """Send ``body`` to the sidecar at ``endpoint`` and return its reply (without the
    protocol keys); None, after one line on stderr, when none answers."""
    from markers.transport import Sender  # the client side of the same wire

    socket_file = endpoints.ipc_path(endpoint)
    if socket_file is not None and not socket_file.exists():
        print(
            f"sidecar {command}: no sidecar at {endpoint} (its socket file does not exist)",
            file=sys.stderr,
        )
        return None
    # a job's own sidecar on ipc keeps its secret beside the socket, for its user
    secret = shared_secret.read_beside(socket_file) if socket_file is not None else None
    sender = Sender(
        endpoints.connect_address(endpoint),
        b"\0" * 16,
        0,
        secret or os.environ.get(shared_secret.ENV),
    )
    try:
        reply = sender.request(body, STATUS_TIMEOUT_S, connect_timeout_s=STATUS_TIMEOUT_S)
        refused = sender.refused
    finally:
        sender.close()
    if reply is None:
        print(
            f"sidecar {command}: "
            + (
                f"{refused} ({endpoint})"
                if refused
                else f"no sidecar answered at {endpoint} within {STATUS_TIMEOUT_S:.0f} s"
            ),
            file=sys.stderr,
        )
        return None
    reply.pop("reply_to", None)
    return reply


def _gpu_line(gpu: dict[str, Any]) -> str:
    answers = f"NVML does not answer ({gpu['lost_reason']})" if gpu["lost"] else "NVML answers"
    unsupported = "; ".join(f"{call} ({why})" for call, why in gpu["unsupported"].items())
    return f"  GPU {gpu['index']} {gpu['name']} {gpu['uuid']}: {answers}" + (
        f"; unsupported: {unsupported}" if unsupported else ""
    )


def _status(endpoint: str, job: str | None, as_json: bool) -> int:
    reply = _ask("status", endpoint, {"type": wire.STATUS})
    if reply is None:
        return 1
    reply.pop("ok", None)
    if job is not None:
        reply["runs"] = [run for run in reply["runs"] if run.get("job_id") == job]
    if as_json:
        print(json.dumps(reply))
        return 0
    samplers = reply["samplers"]
    print(
        f"sidecar pid {reply['pid']} on {reply['endpoint']}; sampling every "
        f"{samplers['interval_s']:g} s: host {samplers['host']}, GPU {samplers['gpu']}"
    )
    print(
        f"records {reply['records']} ({reply['records_per_s']:.0f}/s, mean over the last "
        f"{reply['rate_window_s']:.1f} s), dropped "
        f"{reply['dropped']}, lost {reply['lost']}, rejected {reply['rejected']} "
        f"{reply['rejected_by_kind'] or ''}".rstrip()
    )
    if reply.get("job_ids_dropped"):
        print(
            f"Slurm job ids dropped (their process belongs to no such job): "
            f"{reply['job_ids_dropped']}"
        )
    for gpu in samplers.get("gpus", []):
        print(_gpu_line(gpu))
    if reply.get("last_error"):
        print(f"last error: {reply['last_error']}")
    for run in reply["runs"]:
        job_id = f" job {run['job_id']}" if run.get("job_id") else ""
        print(
            f"  run {run['run_id'][:8]}{job_id} split {run['split']} rank {run['rank']} "
            f"pid {run['pid']} {run['status']}: {run['records']} records -> {run['out_dir']}"
            + (f" (write error: {run['write_error']})" if run["write_error"] else "")
        )
    return 0


def _finish(endpoint: str, job: str) -> int:
    reply = _ask("finish", endpoint, {"type": wire.FINISH_JOB, "job_id": job})
    if reply is None:
        return 1
    if not reply.get("ok"):
        print(f"sidecar finish: refused: {reply.get('error')}", file=sys.stderr)
        return 1
    print(f"sidecar finish: job {job}: {reply['finished']} runs ended and written")
    return 0


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


def _viewers(args: argparse.Namespace) -> Viewers | None:
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


def _in_runtime_folder(make: Callable[[], str]) -> str:
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


def _serve(args: argparse.Namespace, seams: dict[str, Any]) -> int:
    if args.command == "serve":
        problem = _serve_problem(args)
        if problem:
            print(f"sidecar serve: {problem}", file=sys.stderr)
            return USAGE_ERROR
        if args.shared:  # root's supplementary groups must not open users' files
            os.setgroups([])
        config = Config(
            args.endpoint or _in_runtime_folder(endpoints.daemon_endpoint),
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
    endpoint = args.endpoint or _in_runtime_folder(endpoints.private_endpoint)
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


def _asked_endpoint(args: argparse.Namespace) -> str:
    """The sidecar a client command asks: --endpoint, $SIDECAR_ENDPOINT, the daemon's."""
    return (
        args.endpoint
        or os.environ.get("SIDECAR_ENDPOINT")
        or _in_runtime_folder(endpoints.daemon_endpoint)
    )


def main(argv: list[str] | None = None, **seams: Any) -> int:
    """Entry point of the console script and of ``python -m sidecar``; returns the status:
    the job's under ``sidecar run``, 2 for a command-line mistake (one line on stderr).
    ``seams`` go to the server (see ``sidecar.daemon.server.Server``); tests use them."""
    args = _parser().parse_args(argv)
    try:
        if args.command in ("status", "finish"):
            endpoint = _asked_endpoint(args)
            if args.command == "finish":
                return _finish(endpoint, args.job)
            return _status(endpoint, args.job, args.json)
        if args.command == "report":
            return _report(args)
        if args.command in view_commands.COMMANDS:
            return view_commands.main(args, _ask, lambda: _asked_endpoint(args))
        logging.basicConfig(
            format="sidecar[%(process)d] %(levelname)s: %(message)s",
            level=logging.WARNING if args.quiet else logging.INFO,
        )
        if args.metrics_port is not None:
            from sidecar.daemon.metrics import MetricsExporter  # prometheus_client: only here

            viewers = _viewers(args)
            if viewers is None:
                return USAGE_ERROR
            exporter = MetricsExporter(args.metrics_port, args.metrics_addr, viewers)
            seams["hooks"] = [*seams.get("hooks", ()), exporter]
            seams["viewers"] = viewers
        return _serve(args, seams)
    except EndpointError as exc:
        print(f"sidecar {args.command}: {exc}", file=sys.stderr)
    return USAGE_ERROR
