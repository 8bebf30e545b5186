"""Cost of one marker start+stop against the alternatives, measured as users write them.

    python bench/markers_overhead.py [--n 50000] [--repeats 15] [--no-write]

Side by side in one process with torch imported, interleaved, medians of repeats. Every
variant gets a loop function of its own (compiled per variant), so no variant runs on
call sites another one specialized:

* empty loop (subtracted from the others: 'net');
* ``with`` a no-op object (the cost of the ``with`` statement alone);
* bare in-process timer: ``perf_counter`` at enter, list append and cap check at exit
  (the reference monitor's approach);
* ours, natural: ``with run.phase("forward"):`` written inside the loop as the README
  shows (the name lookup included), a real sidecar listening (batched sends included);
* ours, reused: the marker object taken once before the loop;
* ``nvtx.annotate("forward")`` and ``nvtx.push_range``/``pop_range`` (no tool attached);
* ``torch.autograd.profiler.record_function("forward")`` (no profiler attached);
* Lightning's ``SimpleProfiler().profile("forward")``.

Then *layouts*: the same natural/bare pair in fresh processes on copies of ``markers``
with unrelated edits to markers/phase.py (two more methods on Phase; a method renamed).
CPython 3.11's caches made such edits flip the natural path between ~480 and ~850 ns
once; this row shows whether the hot path still depends on that. Writes
``## Marker overhead``. Target: natural ≤ 2× the bare timer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
perf_counter = time.perf_counter
TARGET = 2.0

LOOP = """
def loop(n, m):
    start = perf_counter()
    for _ in range(n):
        {body}
    return perf_counter() - start
"""


def _loop(body: str) -> Callable[[int, Any], float]:
    """A loop function of its own running ``body`` (``m`` is the variant's object)."""
    namespace: dict[str, Any] = {"perf_counter": perf_counter}
    exec(compile(LOOP.format(body=body), f"<loop {body}>", "exec"), namespace)
    return namespace["loop"]


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
    """A context manager that does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


WITH = "with {}:\n            pass"


def variants(run: Any) -> dict[str, tuple[Callable[[int, Any], float], Any]]:
    """name -> (loop, object) of every variant that is installed here."""
    import torch

    out = {
        "empty loop": (_loop("pass"), None),
        "`with` a no-op object": (_loop(WITH.format("m")), Nothing()),
        "bare in-process timer": (_loop(WITH.format("m")), BareTimer(10**9)),
        'ours, natural `with run.phase("forward")`': (
            _loop(WITH.format('m.phase("forward")')),
            run,
        ),
        "ours, reused marker object": (_loop(WITH.format("m")), run.phase("forward")),
        'record_function("forward")': (
            _loop(WITH.format('m("forward")')),
            torch.autograd.profiler.record_function,
        ),
    }
    try:
        import nvtx

        out['nvtx.annotate("forward")'] = (_loop(WITH.format('m("forward")')), nvtx.annotate)
        out["nvtx push_range + pop_range"] = (
            _loop('m.push_range("forward")\n        m.pop_range()'),
            nvtx,
        )
    except ImportError:
        pass
    try:
        from lightning.pytorch.profilers import SimpleProfiler

        out['Lightning SimpleProfiler.profile("forward")'] = (
            _loop(WITH.format('m.profile("forward")')),
            SimpleProfiler(),
        )
    except ImportError:
        pass
    return out


def measure(
    run: Any, n: int, repeats: int, names: list[str] | None = None
) -> dict[str, list[float]]:
    """ns per start+stop of each variant in each repeat (the bare timer's list cleared)."""
    table = variants(run)
    if names is not None:
        table = {k: v for k, v in table.items() if k in names}
    out: dict[str, list[float]] = {name: [] for name in table}
    for loop, obj in table.values():  # warm up: specialization, first sends
        loop(n // 10, obj)
    for _ in range(repeats):
        for name, (loop, obj) in table.items():
            if isinstance(obj, BareTimer):
                obj.times.clear()
            out[name].append(loop(n, obj) / n * 1e9)
    return out


def connected_run(endpoint: str) -> Any:
    """A run of ``markers`` (as imported now) reporting to ``endpoint``."""
    import markers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return markers.start_run(out_dir="overhead", warmup_iterations=0, endpoint=endpoint)


NATURAL = 'ours, natural `with run.phase("forward")`'
BARE = "bare in-process timer"
EMPTY = "empty loop"


def layout_worker(markers_root: str, endpoint: str, n: int, repeats: int) -> None:
    """In a fresh process on a copy of ``markers``: the natural/bare pair as JSON."""
    sys.path.insert(0, markers_root)
    import torch  # noqa: F401  (its types fill the interpreter's caches, as in training)

    run = connected_run(endpoint)
    times = measure(run, n, repeats, [EMPTY, BARE, NATURAL])
    run.finish()
    print("LAYOUT " + json.dumps(times), flush=True)


def _layouts(endpoint: str, n: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """The natural/bare pair on copies of ``markers`` with unrelated edits."""
    edits: dict[str, Callable[[str], str]] = {
        "as committed": lambda text: text,
        # before Phase's own method (PurePhase, above it, is not Phase's base when the
        # C accelerator is built)
        "two more methods on Phase": lambda text: text.replace(
            "    def __call__(self, function: F) -> F:",
            "    def extra_one(self) -> int:\n        return 1\n\n"
            "    def extra_two(self) -> int:\n        return 2\n\n"
            "    def __call__(self, function: F) -> F:",
            1,
        ),
        "a PhaseTable method renamed": lambda text: text.replace("._new(", "._new_marker(").replace(
            "def _new(", "def _new_marker("
        ),
    }
    out = {}
    for name, edit in edits.items():
        with tempfile.TemporaryDirectory(prefix="bench-layout-") as tmp:
            shutil.copytree(
                ROOT / "markers",
                Path(tmp) / "markers",
                ignore=shutil.ignore_patterns("__pycache__"),
            )
            phase_py = Path(tmp) / "markers" / "phase.py"
            phase_py.write_text(edit(phase_py.read_text()))
            done = subprocess.run(
                [sys.executable, __file__, "layout-worker", tmp, endpoint, str(n), str(repeats)],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
                env={**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{ROOT}"},
            )
        line = next(x for x in done.stdout.splitlines() if x.startswith("LAYOUT "))
        out[name] = json.loads(line[len("LAYOUT ") :])
    return out


def _net(times: dict[str, list[float]]) -> dict[str, float]:
    empty = statistics.median(times[EMPTY])
    return {name: statistics.median(v) - empty for name, v in times.items()}


def _ratio(times: dict[str, list[float]], name: str) -> float:
    """Median over repeats of ``name``'s net cost over the bare timer's in the same repeat
    (a load burst from other work on the machine hits both of a repeat alike)."""
    return statistics.median(
        (v - e) / (b - e) for v, b, e in zip(times[name], times[BARE], times[EMPTY], strict=True)
    )


def section(
    times: dict[str, list[float]],
    layouts: dict[str, dict[str, list[float]]],
    n: int,
    repeats: int,
    dropped: int,
) -> tuple[str, dict[str, float]]:
    """The ``## Marker overhead`` section and the headline figures."""
    from bench.common import load_line, spread
    from bench.results import machine_line

    net = _net(times)
    lines = [
        "## Marker overhead",
        "",
        machine_line("python bench/markers_overhead.py") + f" {load_line()} at the "
        f"end. torch imported; {n} start+stops per block, {repeats} interleaved "
        "repeats; per start+stop: median (min–max); 'net' subtracts the empty loop's "
        "median; a real sidecar listening.",
        "",
        "| variant | per start+stop (ns) | net (ns) | net / bare timer |",
        "|---|---:|---:|---:|",
    ]
    for name, values in times.items():
        if name == EMPTY:
            lines.append(f"| {name} | {spread(values)} | | |")
        else:
            lines.append(
                f"| {name} | {spread(values)} | {net[name]:.0f} | {_ratio(times, name):.2f}× |"
            )
    natural = _ratio(times, NATURAL)
    lines += [
        "",
        f"- ours, natural / bare timer: **{natural:.2f}×** (target ≤ {TARGET:.0f}×: "
        f"{'met' if natural <= TARGET else 'missed'}); reused: "
        f"{_ratio(times, 'ours, reused marker object'):.2f}× (ratios: median over repeats of "
        "the net cost over the bare timer's in the same repeat)",
        f"- records the markers could not send during this benchmark: {dropped}",
        "",
        "Layouts (fresh processes, torch imported, copies of `markers` with unrelated edits):",
        "",
        "| layout | natural (net ns) | bare (net ns) | natural / bare |",
        "|---|---:|---:|---:|",
    ]
    ratios = []
    for name, layout_times in layouts.items():
        layout_net = _net(layout_times)
        ratio = _ratio(layout_times, NATURAL)
        ratios.append(ratio)
        lines.append(
            f"| {name} | {layout_net[NATURAL]:.0f} | {layout_net[BARE]:.0f} | {ratio:.2f}× |"
        )
    lines += [
        "",
        f"- natural / bare across layouts: {min(ratios):.2f}…{max(ratios):.2f}× "
        "(a flip would show as one layout near 3×)",
        "",
    ]
    return "\n".join(lines), {
        "natural_vs_bare": natural,
        "layouts_max": max(ratios),
        "layouts_min": min(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["layout-worker"]:
        layout_worker(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50_000, help="start+stops per timed block")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401

    from bench.common import headline, sidecar
    from bench.results import write_section

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, sidecar(Path(tmp)) as (endpoint, _):
        run = connected_run(endpoint)
        times = measure(run, args.n, args.repeats)
        run.finish()
        layouts = _layouts(endpoint, args.n, max(5, args.repeats // 2))
    text, figures = section(times, layouts, args.n, args.repeats, run.dropped)
    print(text)
    if not args.no_write:
        write_section(text)
    headline("markers_overhead", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
