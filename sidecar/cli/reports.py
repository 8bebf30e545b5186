"""``sidecar report``: the report of run folders (or of a Prometheus server), and
``report --job``: one job's efficiency."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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


def report_command(args: argparse.Namespace) -> int:
    """``sidecar report``: the report files of the folders (or of ``--prometheus``) given;
    2 for a command-line mistake, 1 when it cannot be read or written."""
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
