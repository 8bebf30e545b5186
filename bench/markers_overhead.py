"""Cost of one marker start+stop, transport included, against the alternatives.

    python bench/markers_overhead.py [--no-write]

Side by side in one process, interleaved, medians of repeats:

* empty loop: the loop itself, subtracted from the others to get each marker's own cost;
* bare in-process timer: ``perf_counter`` at enter, list append and cap check at exit
  (the reference monitor's approach, written here);
* ours: ``with run.phase("forward")`` of a run connected to a real sidecar process (the
  records are batched and sent: the amortized send is in the figure);
* ours with no sidecar listening (records dropped and counted, the fault path);
* ``torch.autograd.profiler.record_function`` (no profiler attached).

Then a real CPU training step (MLP 784-256-10, batch 64) unmarked and marked
(train_batches + forward/backward/optimization). Writes ``## Marker overhead`` into
bench/RESULTS.md. Targets: ours ≤ 2× the bare timer, ≥ 10× cheaper than record_function.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import markers  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402

perf_counter = time.perf_counter


class BareTimer:
    """The reference's in-process timer: perf_counter, list append, cap check."""

    __slots__ = ("cap", "start", "times")

    def __init__(self, cap: int) -> None:
        self.cap, self.start, self.times = cap, 0.0, []

    def __enter__(self) -> BareTimer:
        self.start = perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if len(self.times) < self.cap:
            self.times.append(perf_counter() - self.start)


class Nothing:
    """A context manager that does nothing (the cost of the ``with`` statement alone)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def time_with(marker: AbstractContextManager[object], n: int) -> float:
    """Seconds for ``n`` entries and exits of ``marker``."""
    start = perf_counter()
    for _ in range(n):
        with marker:
            pass
    return perf_counter() - start


def time_loop(n: int) -> float:
    """Seconds for the bare loop."""
    start = perf_counter()
    for _ in range(n):
        pass
    return perf_counter() - start


def start_sidecar(folder: Path) -> tuple[str, subprocess.Popen[bytes]]:
    endpoint = f"ipc://{folder}/sidecar.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "sidecar", "serve", "--quiet",
                                "--endpoint", endpoint, "--root", str(folder)], env=env)
    while not (folder / "sidecar.sock").exists():
        time.sleep(0.05)
    return endpoint, process


def markers_only(run: markers.Run, batches: list[tuple[int, int]]) -> None:
    """The marked loop of ``mlp_case`` with no model: what the markers cost per step."""
    for _ in run.train_batches(batches):
        with run.phase("forward"):
            pass
        with run.phase("backward"):
            pass
        with run.phase("optimization"):
            pass


def mlp_case(steps: int) -> tuple[Callable[[], None], Callable[[markers.Run], None],
                                  nn.Module, torch.optim.Optimizer]:
    """``steps`` MLP training steps, plain and marked (one train_batches loop), and the
    model and optimizer they train (for bench/instrument_overhead.py's hooks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()

    batches = [(x, y)] * steps

    def plain() -> None:
        for _ in iter(batches):
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def marked(run: markers.Run) -> None:
        for _ in run.train_batches(batches):
            with run.phase("forward"):
                loss = loss_fn(model(x), y)
            with run.phase("backward"):
                optimizer.zero_grad()
                loss.backward()
            with run.phase("optimization"):
                optimizer.step()

    return plain, marked, model, optimizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50_000, help="start+stops per timed block")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=200, help="MLP steps per timed block")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        endpoint, sidecar = start_sidecar(Path(tmp))
        try:
            live = markers.start_run(out_dir="bench", warmup_iterations=0, endpoint=endpoint)
            markers.CONNECT_TIMEOUT_S = 0.5
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                absent = markers.start_run(out_dir="bench",
                                           endpoint=f"ipc://{tmp}/nobody.sock")
            variants: dict[str, Callable[[], float]] = {
                "empty loop": lambda: time_loop(args.n),
                "`with` a no-op object": lambda: time_with(Nothing(), args.n),
                "bare in-process timer": lambda: time_with(BareTimer(10**9), args.n),
                "ours (sidecar listening)": lambda: time_with(live.phase("forward"), args.n),
                "ours (no sidecar: dropped)": lambda: time_with(absent.phase("forward"),
                                                                args.n),
                "record_function": lambda: time_with(
                    torch.autograd.profiler.record_function("forward"), args.n),
            }
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, measure in variants.items():
                    seconds[name].append(measure())
            plain, marked, _model, _optimizer = mlp_case(args.steps)
            empty = [(0, 0)] * (args.steps * 10)
            steps: dict[str, list[float]] = {"unmarked": [], "unmarked again": [],
                                             "marked": [], "markers only": []}
            for repeat in range(args.repeats):
                order = [("unmarked", plain), ("marked", lambda: marked(live)),
                         ("unmarked again", plain)]
                for name, step in order if repeat % 2 else order[::-1]:
                    start = perf_counter()
                    step()
                    steps[name].append((perf_counter() - start) / args.steps)
                start = perf_counter()
                markers_only(live, empty)
                loop_s = perf_counter() - start
                start = perf_counter()
                for _ in iter(empty):
                    pass
                steps["markers only"].append((loop_s - perf_counter() + start) / len(empty))
            live.finish()
            absent.finish()
            dropped = absent.dropped
        finally:
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(timeout=10)

    per_op_ns = {name: statistics.median(v) / args.n * 1e9 for name, v in seconds.items()}
    loop_ns = per_op_ns["empty loop"]
    net = {name: value - loop_ns for name, value in per_op_ns.items()}
    ours, bare, rf = (net["ours (sidecar listening)"], net["bare in-process timer"],
                      net["record_function"])
    step = {k: statistics.median(v) for k, v in steps.items()}
    lines = [
        "## Marker overhead", "",
        machine_line("python bench/markers_overhead.py") + f" {args.n} start+stops per "
        f"block, medians of {args.repeats} interleaved repeats; 'net' subtracts the empty "
        "loop.", "",
        "| variant | per start+stop (ns) | net (ns) |",
        "|---|---:|---:|",
        *(f"| {name} | {per_op_ns[name]:.0f} | {net[name]:.0f} |" for name in variants
          if name != "empty loop"),
        "",
        f"- ours / bare in-process timer: **{ours / bare:.2f}×** (target ≤ 2×)",
        f"- record_function / ours: **{rf / ours:.1f}×** (target ≥ 10×)",
        f"- with no sidecar listening the markers queued up to their bound, then dropped "
        f"and counted {dropped} records, at {net['ours (no sidecar: dropped)'] / ours:.2f}× "
        "the connected cost",
        f"- MLP 784-256-10 CPU step, batch 64: unmarked {step['unmarked'] * 1e6:.0f} µs, "
        f"marked {step['marked'] * 1e6:.0f} µs "
        f"(**{(step['marked'] / step['unmarked'] - 1) * 100:+.2f} %**; the same unmarked "
        f"loop run twice differs by {(step['unmarked again'] / step['unmarked'] - 1) * 100:+.2f}"
        " %, the noise floor of this machine); the markers alone (same loop, no model) cost "
        f"**{step['markers only'] * 1e6:.1f} µs per step** for its 5 records (data loading, "
        "three phases, loop) and the iteration's context",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
