"""The sidecar's own footprint on the job: its CPU time per second of wall time.

A real ``sidecar serve`` process with 8 fake GPUs whose NVML calls take a real driver's
latencies (``tests.support.fake_pynvml.DRIVER_LATENCY_S``) and psutil on the real
process tree of its runs, sampling at its default interval (1 s). Its CPU time
(user + system, every thread: the loop, ZeroMQ's, the GPUs' NVML threads) is read from
the kernel (``psutil.Process.cpu_times``) over a window of steady state, in three states:

* *idle*: no run;
* *1 run*: one process running a training loop of 100 ms steps (data loading, forward,
  backward, optimization: ``train_batches`` and three ``run.phase``);
* *1 run, no sampling*: the same with an interval of 1 h (one round at the start): what
  is left is the rest of the sidecar, so the difference is what sampling costs;
* *8 ranks*: 8 such processes, the ranks of one split.

With ``--base REF`` the same states run, in turn, on the sidecar code of git revision
REF (exported to a temporary folder) and on this tree's (A B A B ...), so the two are
compared side by side under the same load; each state twice on this tree alone is the
noise floor otherwise. The producers (the job) are always this tree's markers.

    python bench/sidecar_footprint.py [--window-s 15] [--repeats 2] [--base REF] [--no-write]

Writes the section "## Sidecar footprint" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
N_GPUS = 8
STEP_S = 0.1
# the share of a step each part takes (the rest: the loop's own code)
PARTS = (("forward", 0.4), ("backward", 0.4), ("optimization", 0.15))
LOADING_S = 0.05 * STEP_S
NO_SAMPLING = "1 run, no sampling (interval 1 h)"
# state -> (ranks, the sidecar's sampling interval, s)
STATES = {"idle": (0, 1.0), "1 run": (1, 1.0), NO_SAMPLING: (1, 3600.0), "8 ranks": (8, 1.0)}
WARM_S = 3.0  # after the producers said hello: their first rounds, the first writes


# -- the sidecar, on any revision's code -------------------------------------------------


def serve(code_root: str, endpoint: str, folder: str, interval_s: str) -> int:
    """``sidecar serve`` from ``code_root`` with 8 fake GPUs at driver latencies (this
    tree's fake, behind the same pynvml interface)."""
    sys.path.insert(0, code_root)
    spec = importlib.util.spec_from_file_location(
        "fake_pynvml", ROOT / "tests" / "support" / "fake_pynvml.py"
    )
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    sys.modules["fake_pynvml"] = fake  # its dataclasses look their module up there
    spec.loader.exec_module(fake)
    from sidecar import cli
    from sidecar.resources.samplers import nvml

    def open_gpus(visible: str | None, **options: Any) -> Any:
        gpus = [
            fake.FakeGpu(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", gpm=True)
            for i in range(N_GPUS)
        ]
        return nvml.open_nvml(
            visible, api=fake.FakeNvml(gpus, latency_s=fake.DRIVER_LATENCY_S), **options
        )

    return int(
        cli.main(
            [
                "serve",
                "--quiet",
                "--endpoint",
                endpoint,
                "--root",
                folder,
                "--interval",
                interval_s,
            ],
            open_gpus=open_gpus,
        )
    )


@contextmanager
def sidecar(code_root: Path, folder: Path, interval_s: float) -> Any:
    """A sidecar on ``code_root``'s code listening in ``folder``, sampling every
    ``interval_s``; yields its Popen."""
    from bench.common import serving  # this tree's bench (the parent; see main)

    socket_file = folder / "sidecar.sock"
    process = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "serve",
            str(code_root),
            f"ipc://{socket_file}",
            str(folder),
            str(interval_s),
        ],
        env={**os.environ, "PYTHONPATH": str(code_root)},
        stdin=subprocess.DEVNULL,
    )
    with serving(process, socket_file):
        yield process


# -- the job: ranks running a training loop ----------------------------------------------


def rank(endpoint: str, number: int, world: int) -> int:
    """One rank: a training loop of STEP_S steps until its stdin closes."""
    os.environ["WORLD_SIZE"] = str(world)
    import markers

    run = markers.start_run(
        out_dir="footprint", endpoint=endpoint, rank=number, train_batch_size=16
    )
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)

    def loader() -> Any:
        for batch in itertools.count():
            time.sleep(LOADING_S)
            yield batch
            if stop.is_set():
                return

    for _ in run.train_batches(loader()):
        for name, share in PARTS:
            with run.phase(name):
                time.sleep(share * STEP_S)
    run.finish()
    return 0


@contextmanager
def ranks(endpoint: str, count: int) -> Any:
    """``count`` ranks of one split running, each said hello; stopped on exit."""
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "rank", endpoint, str(number), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for number in range(count)
    ]
    try:
        for process in processes:
            assert process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError("a rank did not start")
        yield processes
    finally:
        for process in processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in processes:
            process.wait(60)


# -- measuring ---------------------------------------------------------------------------


def cpu_ms_per_s(process: subprocess.Popen[Any], window_s: float) -> float:
    """The process's CPU time (user + system, all threads) per second of wall time over
    ``window_s``, ms/s."""
    import psutil

    watched = psutil.Process(process.pid)
    before, began = watched.cpu_times(), time.monotonic()
    time.sleep(window_s)
    after, wall_s = watched.cpu_times(), time.monotonic() - began
    used_s = (after.user - before.user) + (after.system - before.system)
    return 1000 * used_s / wall_s


def one_state(code_root: Path, state: str, window_s: float) -> float:
    """A fresh sidecar on ``code_root`` in ``state``: its CPU ms/s over the window."""
    count, interval_s = STATES[state]
    with (
        tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmp,
        sidecar(code_root, Path(tmp), interval_s) as process,
    ):
        time.sleep(WARM_S)  # NVML opened, imports done
        endpoint = f"ipc://{Path(tmp) / 'sidecar.sock'}"
        if not count:
            return cpu_ms_per_s(process, window_s)
        with ranks(endpoint, count):
            time.sleep(WARM_S)
            return cpu_ms_per_s(process, window_s)


def export(revision: str, into: Path) -> Path:
    """The tree of ``revision`` in ``into`` (``git archive``)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(window_s: float, repeats: int, base: str | None) -> dict[str, dict[str, list[float]]]:
    """Per code ("base", "this tree", "this tree again") and state, the ms/s of each
    repeat, the codes in turn within each repeat."""
    with tempfile.TemporaryDirectory(prefix="bench-footprint-base-") as tmp:
        codes = {"this tree": ROOT, "this tree again": ROOT}
        if base is not None:
            codes = {f"base {base}": export(base, Path(tmp)), "this tree": ROOT}
        figures: dict[str, dict[str, list[float]]] = {code: {} for code in codes}
        for _ in range(repeats):
            for state in STATES:
                for code, code_root in codes.items():
                    value = one_state(code_root, state, window_s)
                    figures[code].setdefault(state, []).append(value)
                    print(f"{code:>24} {state:>8}: {value:6.2f} ms/s", flush=True)
    return figures


def section(
    figures: dict[str, dict[str, list[float]]], window_s: float, repeats: int, load: str
) -> str:
    from bench.results import machine_line

    codes = list(figures)
    lines = [
        "## Sidecar footprint",
        "",
        machine_line("python bench/sidecar_footprint.py")
        + f" {load}. A real `sidecar serve` (its default interval, 1 s; "
        f"{N_GPUS} fake GPUs whose NVML calls take a driver's latencies, `DRIVER_LATENCY_S`; "
        "psutil on the real process tree of its runs); each rank a process running a "
        f"training loop of {STEP_S * 1e3:.0f} ms steps (`train_batches` and three phases). "
        "The sidecar's CPU time, user + system of all its threads, per second of wall "
        f"time over {window_s:g} s of steady state, ms/s (10 ms/s = 1 % of one core), "
        f"median of {repeats} (min–max), a fresh sidecar each, the codes in turn.",
        "",
        "| state | " + " | ".join(codes) + " |",
        "|---|" + "---:|" * len(codes),
    ]
    for state in STATES:
        cells = []
        for code in codes:
            values = figures[code][state]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})")
        lines.append(f"| {state} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["serve"]:
        return serve(*args_in[1:5])
    if args_in[:1] == ["rank"]:
        return rank(args_in[1], int(args_in[2]), int(args_in[3]))
    sys.path.insert(0, str(ROOT))
    from bench.common import headline, load_line
    from bench.results import write_section

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--base", help="a git revision whose sidecar runs beside this one")
    parser.add_argument("--no-write", action="store_true", help="print, do not write")
    args = parser.parse_args(args_in)
    before = load_line()
    figures = measure(args.window_s, args.repeats, args.base)
    text = section(figures, args.window_s, args.repeats, f"{before} before, {load_line()} after")
    print(text)
    if not args.no_write:
        write_section(text)
    ours = figures["this tree"]
    headline(
        "sidecar_footprint",
        {
            key: round(statistics.median(ours[state]), 2)
            for key, state in zip(
                ("idle_ms_s", "run_ms_s", "run_unsampled_ms_s", "ranks_ms_s"), STATES, strict=True
            )
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
