"""The command lines of ``sidecar top``, ``sidecar trace`` and ``sidecar compare``
(docs/views.md): their parsers, added to the ``sidecar`` parser, and what each runs.
Heavy imports (pandas, numpy, Rich) happen only in the command that needs them."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

COMMANDS = ("top", "trace", "compare")
USAGE_ERROR = 2


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: give a percentage of 0 or more")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value}: give 2 or more")
    return value


def add_commands(commands: Any, endpoint: Callable[[str], str]) -> None:
    """Add the view commands to the ``sidecar`` subparsers ``commands``; ``endpoint``
    checks an ``--endpoint`` value."""
    top = commands.add_parser("top", help="live view of the runs a sidecar serves (q quits)")
    top.add_argument(
        "--endpoint", type=endpoint, help="default: $SIDECAR_ENDPOINT, else the daemon's"
    )
    top.add_argument("--job", help="show only the runs of this Slurm job id")
    top.add_argument("--run", metavar="ID", help="show only the run whose id starts with ID")
    top.add_argument(
        "--token-file",
        type=Path,
        help="a /metrics token (the admin's sees every run of a shared daemon)",
    )
    top.add_argument("--once", action="store_true", help="print one view and exit")
    trace = commands.add_parser(
        "trace", help="a run's timeline as Chrome Trace Event JSON (Perfetto, speedscope)"
    )
    trace.add_argument("folder", type=Path, metavar="FOLDER", help="run folder or split folder")
    trace.add_argument("--split", type=int, help="the split (default: the folder's only one)")
    trace.add_argument(
        "--out", type=Path, default=Path("trace.json"), help="file to write (default trace.json)"
    )
    trace.add_argument(
        "--max-points",
        type=_count,
        default=2000,
        metavar="N",
        help="points kept per counter series (neighbours averaged; default 2000)",
    )
    compare = commands.add_parser(
        "compare", help="two run folders (or splits) side by side; a CI gate on speed"
    )
    compare.add_argument(
        "folders",
        nargs=argparse.REMAINDER,
        metavar="BASE... [-- NEW...]",
        help="BASE NEW, or several runs per side split by --; a run folder, a split folder, "
        "or a folder of run folders",
    )
    _compare_options(compare)


def _compare_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``sidecar compare`` (read before and among its folders)."""
    parser.add_argument("--split", type=int, help="the split of every run folder")
    parser.add_argument(
        "--max-regression",
        type=_percent,
        metavar="PCT",
        help="exit 1 when step time or throughput is worse than PCT %% beyond its interval",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


SEPARATOR = "\0--"  # stands for "--" while the folders' options are read


class _Mistake(Exception):
    """A usage mistake among ``sidecar compare``'s folders and options."""


class _OptionReader(argparse.ArgumentParser):
    """Reads the options among the folders; a mistake raises ``_Mistake`` (one line)."""

    def error(self, message: str) -> NoReturn:
        """Raise ``_Mistake(message)`` instead of printing the usage and exiting."""
        raise _Mistake(message)


def _sides(args: argparse.Namespace) -> tuple[list[Path], list[Path]] | None:
    """(BASE folders, NEW folders) from ``args.folders``, its options read into ``args``;
    None (after one line on stderr) for a usage mistake."""
    reader = _OptionReader(prog="sidecar compare", add_help=False)
    _compare_options(reader)
    tokens = [SEPARATOR if t == "--" else t for t in args.folders]
    try:
        options, folders = reader.parse_known_args(tokens)
    except _Mistake as exc:
        print(f"sidecar compare: {exc} (see sidecar compare --help)", file=sys.stderr)
        return None
    for name in ("split", "max_regression"):
        if getattr(options, name) is not None:
            setattr(args, name, getattr(options, name))
    args.json = args.json or options.json
    if SEPARATOR in folders:
        cut = folders.index(SEPARATOR)
        base, new = folders[:cut], folders[cut + 1 :]
    elif len(folders) == 2:
        base, new = folders[:1], folders[1:]
    else:
        base = new = []
    if not base or not new or SEPARATOR in new or any(f.startswith("-") for f in base + new):
        print(
            "sidecar compare: give BASE NEW, or BASE... -- NEW... (one or more folders a side)",
            file=sys.stderr,
        )
        return None
    return [Path(f) for f in base], [Path(f) for f in new]


def _runs(path: Path) -> list[Path]:
    """The run folders ``path`` names: itself, or for a folder of runs (no run.json of
    its own) every subfolder holding a run.json, in name order."""
    if (path / "run.json").is_file() or not path.is_dir():
        return [path]
    found = sorted(p for p in path.iterdir() if (p / "run.json").is_file())
    return found or [path]


def _compare(args: argparse.Namespace) -> int:
    from sidecar.report import compare, split_rows
    from sidecar.report.read import Damaged

    sides = _sides(args)
    if sides is None:
        return USAGE_ERROR
    runs: list[list[split_rows.SplitRows]] = [[], []]
    for side, paths in zip(runs, sides, strict=True):
        for path in paths:
            if not path.is_dir():
                print(f"sidecar compare: no such folder: {path}", file=sys.stderr)
                return USAGE_ERROR
            try:
                side += [
                    split_rows.read_split(*split_rows.locate(run, args.split))
                    for run in _runs(path)
                ]
            except Damaged as exc:
                print(f"sidecar compare: {exc}", file=sys.stderr)
                return 1
    result = compare.compare(*runs)
    decided = None
    if args.max_regression is not None:
        decided = compare.gate(result, args.max_regression)
    if args.json:
        body = compare.as_json(result)
        if decided is not None:
            body["gate"] = {"passed": decided[0], "line": decided[1]}
        print(json.dumps(body, indent=2))
    else:
        print("\n".join(compare.render(result)))
        if decided is not None:
            print("\n".join(compare.gate_lines(decided[1])))
    return 0 if decided is None or decided[0] else 1


def _trace(args: argparse.Namespace) -> int:
    from sidecar.report import split_rows, trace
    from sidecar.report.read import Damaged
    from sidecar.sinks.atomic import write_atomic

    if not args.folder.is_dir():
        print(f"sidecar trace: no such folder: {args.folder}", file=sys.stderr)
        return USAGE_ERROR
    try:
        rows = split_rows.read_split(*split_rows.locate(args.folder, args.split))
    except Damaged as exc:
        print(f"sidecar trace: {exc}", file=sys.stderr)
        return 1
    document = trace.build(rows, args.max_points)
    text = json.dumps(document, separators=(",", ":"))
    try:
        write_atomic(args.out, text)
    except OSError as exc:
        print(f"sidecar trace: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    kinds = [event["ph"] for event in document["traceEvents"]]
    print(
        f"wrote {args.out} ({len(text) / 1e6:.2f} MB): {kinds.count('X')} slices on "
        f"{len(document['otherData']['ranks'])} rank tracks, {kinds.count('C')} counter points"
    )
    return 0


def _top(args: argparse.Namespace, ask: Any, endpoint: Callable[[], str]) -> int:
    from sidecar.daemon.viewers import read_token
    from sidecar.views.top import top

    token = None
    if args.token_file is not None:
        try:
            token = read_token(args.token_file)
        except (OSError, ValueError) as exc:
            print(f"sidecar top: cannot read --token-file: {exc}", file=sys.stderr)
            return USAGE_ERROR
    return top(ask, endpoint(), args.job, args.run, token, args.once)


def main(args: argparse.Namespace, ask: Any, endpoint: Callable[[], str]) -> int:
    """Run the view command ``args.command``; its exit status. ``ask`` sends a control to
    a sidecar (``sidecar.cli``), ``endpoint`` gives the endpoint to ask by default."""
    if args.command == "top":
        return _top(args, ask, endpoint)
    return {"trace": _trace, "compare": _compare}[args.command](args)
