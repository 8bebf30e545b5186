"""``sidecar top``: a live terminal view of the runs a sidecar serves, about once a second.

It asks the sidecar's status control for every split's figures (``splits``: the
snapshot's ``SplitView``, what ``/metrics`` exports) and shows, per run and rank, what
happened over the last few seconds: the difference between the figures of now and of
``WINDOW_S`` ago (steps, their phases' seconds, samples). The sidecar filters what the
caller sees (its own runs on a shared daemon; all for root or the admin's token).
A run no longer served stays shown as ended. Drawn with Rich, 80 columns.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from markers import wire

REFRESH_S = 1.0
WINDOW_S = 5.0  # the span the live figures cover
WIDTH = 80
BAR_CELLS = 24
_COLOURS = ("red", "green", "blue", "magenta", "cyan", "yellow")  # the step parts', in order
# The parts of a step, in bar order: (wire id or None for the rest, label, letter, colour):
# the phase table's step parts, then the rest of the step.
STEP_PARTS: tuple[tuple[int, str, str, str], ...] = tuple(
    (p.phase, p.summary_label.lower(), p.summary_label[0], _COLOURS[i % len(_COLOURS)])
    for i, p in enumerate(wire.STEP_PHASES)
)
PARTS: tuple[tuple[int | None, str, str, str], ...] = (*STEP_PARTS, (None, "other", ".", "white"))
Ask = Callable[[str, str, dict[str, Any]], dict[str, Any] | None]


@dataclass
class Reading:
    """One rank's cumulative figures at one status reply."""

    taken_unix: float
    sums_s: dict[int, float]  # phase id -> seconds of its post-warmup measurements
    counts: dict[int, int]
    samples: int | None


@dataclass
class Tracked:
    """A split seen in some reply: its latest view and the readings of its ranks."""

    view: dict[str, Any]
    readings: dict[int, deque[Reading]] = field(default_factory=dict)
    cpu: deque[tuple[float, float]] = field(default_factory=deque)  # (taken, CPU s)
    gone: bool = False  # no longer in the sidecar's replies


@dataclass(frozen=True)
class Window:
    """A rank's figures over the window (``windowed``), or since its start when no step
    ended in the window."""

    step_s: float | None
    shares: dict[str, float]
    samples_per_s: float | None
    windowed: bool


def _reading(rank: dict[str, Any], taken: float) -> Reading:
    phases = [p for p in rank["phases"] if not p["name"]]  # standard phases
    return Reading(
        taken,
        {p["phase"]: p["sum_s"] for p in phases},
        {p["phase"]: p["count"] for p in phases},
        rank.get("train_samples"),
    )


def live_figures(history: deque[Reading]) -> Window:
    """A rank's step time, phase shares and throughput over the window, from the first
    and last readings of ``history``; since its start when no step ended in the window."""
    last = history[-1]
    first = history[0]
    loop = wire.TRAINING_LOOP
    steps = last.counts.get(loop, 0) - first.counts.get(loop, 0)
    windowed = steps > 0 and len(history) > 1
    base = first if windowed else Reading(0.0, {}, {}, 0)
    steps = last.counts.get(loop, 0) - base.counts.get(loop, 0)
    loop_s = last.sums_s.get(loop, 0.0) - base.sums_s.get(loop, 0.0)
    if steps <= 0 or loop_s <= 0:
        return Window(None, {}, None, False)
    shares = {}
    for phase, label, _, _ in STEP_PARTS:
        spent = last.sums_s.get(phase, 0.0) - base.sums_s.get(phase, 0.0)
        shares[label] = max(spent, 0.0) / loop_s
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    rate = None
    if last.samples is not None and base.samples is not None:
        rate = (last.samples - base.samples) / loop_s
    return Window(loop_s / steps, shares, rate, windowed)


class Board:
    """What top shows: every split seen, tracked across replies."""

    def __init__(self, job: str | None, run: str | None) -> None:
        self.job = job
        self.run = run
        self.splits: dict[tuple[str, int], Tracked] = {}
        self.source = self.clock = self.note = ""

    def _wanted(self, view: dict[str, Any]) -> bool:
        return (self.job is None or view["slurm_job_id"] == self.job) and (
            self.run is None or view["run_id"].startswith(self.run)
        )

    def update(self, reply: dict[str, Any]) -> None:
        """Take a status reply (with ``splits``)."""
        taken = float(reply["taken_unix"])
        seen = set()
        for view in reply.get("splits", []):
            if not self._wanted(view):
                continue
            key = (view["folder"] or view["run_id"], int(view["split"]))
            seen.add(key)
            tracked = self.splits.setdefault(key, Tracked(view))
            tracked.view, tracked.gone = view, False
            for rank in view["ranks"]:
                history = tracked.readings.setdefault(rank["rank"], deque())
                history.append(_reading(rank, taken))
                while len(history) > 2 and taken - history[1].taken_unix >= WINDOW_S:
                    history.popleft()
            cpu_s = view["host_gauges"].get("trainmon_job_cpu_seconds")
            if cpu_s is not None:
                tracked.cpu.append((taken, float(cpu_s)))
                while len(tracked.cpu) > 2 and taken - tracked.cpu[1][0] >= WINDOW_S:
                    tracked.cpu.popleft()
        for key, tracked in self.splits.items():
            tracked.gone = key not in seen
        self.source = f"pid {reply['pid']} on {reply['endpoint']}"
        self.clock = time.strftime("%H:%M:%S", time.localtime(taken))
        self.note = ""

    @property
    def header(self) -> str:
        """``sidecar top: pid P on ENDPOINT, HH:MM:SS[; NOTE]; q quits`` in ``WIDTH``
        columns: a long endpoint gives up its middle (``…``), never the clock, the note or
        how to quit."""
        tail = f", {self.clock}" + (f"; {self.note}" if self.note else "") + "; q quits"
        head = "sidecar top: "
        room = WIDTH - len(head) - len(tail)
        source = self.source
        if len(source) > room:
            keep = max(room - 1, 0)
            source = source[: (keep + 1) // 2] + "…" + source[len(source) - keep // 2 :]
        return (head + source + tail)[-WIDTH:] if self.source else ""

    def render(self) -> Group:
        """The whole view, 80 columns."""
        lines: list[Text] = [Text(self.header, style="bold")]
        if not self.splits:
            lines.append(Text("no run to show yet"))
        for tracked in self.splits.values():
            lines += _split_lines(tracked)
        legend = Text("bar: ")
        for _, label, letter, colour in PARTS:
            legend.append(f"{letter} {label}  ", style=colour)
        lines.append(legend)
        return Group(*lines)


def _status(tracked: Tracked) -> str:
    view = tracked.view
    if view["status"] == "running" and not tracked.gone:
        return "running"
    if view.get("end_unix"):
        ended = time.strftime("%H:%M:%S", time.localtime(view["end_unix"]))
        return f"ended {ended}, {view['status']}"
    return f"ended ({view['status']}; no longer served)"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _bar(shares: dict[str, float]) -> Text:
    bar = Text()
    used = 0
    for index, (_, label, letter, colour) in enumerate(PARTS):
        cells = BAR_CELLS - used if index == len(PARTS) - 1 else round(shares[label] * BAR_CELLS)
        cells = max(0, min(cells, BAR_CELLS - used))
        bar.append(letter * cells, style=colour)
        used += cells
    return bar


def _split_lines(tracked: Tracked) -> list[Text]:
    view = tracked.view
    job = f" job {view['slurm_job_id']}" if view["slurm_job_id"] else ""
    title = (
        f"run {view['run_id'][:8]}{job} split {view['split']} {os.path.basename(view['folder'])}"
        f" ({view['user']}@{view['host']}): {_status(tracked)}"
    )
    lines = [Text(title[:WIDTH], style="bold cyan")]
    lines.append(Text(" rank epoch   iter     step  samples/s  stall  phases of a step"))
    overall: dict[str, float] = {}
    for rank in view["ranks"]:
        history = tracked.readings.get(rank["rank"])
        figures = live_figures(history) if history else Window(None, {}, None, False)
        step = "-" if figures.step_s is None else f"{figures.step_s * 1e3:.1f}ms"
        rate = "-" if figures.samples_per_s is None else f"{figures.samples_per_s:.0f}"
        stall = f"{figures.shares['data loading'] * 100:.0f}%" if figures.shares else "-"
        mark = "" if figures.windowed or figures.step_s is None else "*"
        line = Text(  # rank, epoch, iteration, step time (* since start), samples/s, stall
            f" {rank['rank']:>4} {rank['epoch']:>5} {rank['iteration']:>6} {step:>8}{mark:1}"
            f"{rate:>10} {stall:>6}  "
        )
        if figures.shares:
            line.append_text(_bar(figures.shares))
            for label, share in figures.shares.items():
                overall[label] = overall.get(label, 0.0) + share / len(view["ranks"])
        lines.append(line)
    if overall:
        lines.append(
            Text(
                " phases: "
                + ", ".join(f"{label} {share * 100:.0f}%" for label, share in overall.items())
            )
        )
    for gpu in view["gpus"]:
        gauges = gpu["gauges"]
        busy = gauges.get("trainmon_gpu_utilization_ratio")
        power = gauges.get("trainmon_gpu_power_watts")
        lines.append(
            Text(
                f" GPU {gpu['index']} {gpu['model'][:20]}: "
                f"{'-' if busy is None else f'{busy * 100:.0f}'} % busy, memory "
                f"{_gib(gauges.get('trainmon_gpu_memory_used_bytes'))}/"
                f"{_gib(gauges.get('trainmon_gpu_memory_total_bytes'))} GiB, "
                f"{'-' if power is None else f'{power:.0f}'} W"
            )
        )
    lines.append(Text(_job_line(tracked)[:WIDTH]))
    straggler = _straggler_line(view)
    return lines if straggler is None else [*lines, straggler]


def _job_line(tracked: Tracked) -> str:
    view = tracked.view
    cpu = "-"
    if len(tracked.cpu) > 1 and tracked.cpu[-1][0] > tracked.cpu[0][0]:
        (t0, c0), (t1, c1) = tracked.cpu[0], tracked.cpu[-1]
        cpu = f"{(c1 - c0) / (t1 - t0) * 100:.0f}"
    records = view["records"]
    text = (
        f" job CPU {cpu} %, RSS {_mib(view['host_gauges'].get('trainmon_job_memory_rss_bytes'))}"
        f" MiB; records dropped {records['dropped']}, lost {records['lost']}"
    )
    return text


def _straggler_line(view: dict[str, Any]) -> Text | None:
    """The rank most often the slowest of several, from the sidecar's standings."""
    standings = [s for s in view.get("standings") or [] if s["slowest"] > 0]
    if len(view["ranks"]) < 2 or not standings:
        return None
    worst = max(standings, key=lambda s: s["slowest"])
    text = (
        f" straggler rank {worst['rank']} on {worst['host']} ({worst['phase'] or '?'}): "
        f"slowest in {worst['slowest_share'] * 100:.0f} % of the compared steps"
    )
    return Text(text[:WIDTH], style="yellow")


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """A reader of one key within a timeout (cbreak mode when stdin is a terminal)."""
    if not sys.stdin.isatty():

        def wait(timeout_s: float) -> str:
            time.sleep(timeout_s)
            return ""

        yield wait
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout_s: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return os.read(fd, 32).decode(errors="replace") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def top(
    ask: Ask,
    endpoint: str,
    job: str | None = None,
    run: str | None = None,
    token: str | None = None,
    once: bool = False,
) -> int:
    """Show the live view until ``q`` or Ctrl-C (exit 0); 1, after one line on stderr,
    when no sidecar answers at the start. ``once``: print one view and return."""
    body: dict[str, Any] = {"type": wire.STATUS, "splits": True}
    if token:
        body["token"] = token
    reply = ask("top", endpoint, body)
    if reply is None:
        return 1
    board = Board(job, run)
    board.update(reply)
    console = Console(width=WIDTH)
    if once:
        time.sleep(REFRESH_S)  # a second reading: figures over a window, not since start
        reply = ask("top", endpoint, body) or reply
        board.update(reply)
        console.print(board.render())
        return 0
    try:
        with _keys() as key, Live(board.render(), console=console, screen=True) as live:
            while "q" not in key(REFRESH_S).lower():
                with contextlib.redirect_stderr(io.StringIO()):  # a missed answer: keep the view
                    reply = ask("top", endpoint, body)
                if reply is not None:
                    board.update(reply)
                else:
                    board.note = "no answer from the sidecar"
                live.update(board.render())
    except KeyboardInterrupt:
        pass
    return 0
