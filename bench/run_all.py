"""Every benchmark in one command: ``python bench/run_all.py`` (under 15 minutes here).

Runs each benchmark script in a fresh process, in this order, each replacing its own
section of bench/RESULTS.md: marker cost, loop driver step, cold-cache cost, end to end,
sidecar ingest and memory, write time vs cap, checkpoint cost, sampler cost, NVML round,
the sidecar's CPU footprint, ``instrument()`` overhead, CURVE cost, report scale, exports cost, GPU
overhead (only where CUDA exists; elsewhere its section says plainly that it was not
run). Then it writes ``## Summary`` at the top: the machine, the load before and after
(the machine is shared), each benchmark's wall time and exit status, and the headline
figures the README quotes, against their targets.
A benchmark that fails leaves its previous section alone and is marked failed here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import HEADLINE, load_line  # noqa: E402
from bench.results import write_section  # noqa: E402

BENCH_TIMEOUT_S = 600
# (script, arguments) in the order they run; sized so that the whole fits in 15 minutes
# on a 2-core machine that is not overloaded.
BENCHMARKS: list[tuple[str, list[str]]] = [
    ("markers_overhead.py", []),
    ("driver_step.py", []),
    ("cold_cache.py", []),
    ("end_to_end.py", []),
    ("ingest.py", []),
    ("write_cap.py", []),
    ("checkpoint_cost.py", []),
    ("sampler_cost.py", []),
    ("nvml_round.py", []),
    ("sidecar_footprint.py", ["--window-s", "10", "--repeats", "1"]),
    ("instrument_overhead.py", []),
    ("step_sizes.py", []),
    ("curve_cost.py", []),
    ("report_scale.py", ["--repeats", "2"]),
    ("exports_cost.py", []),
    ("gpu_overhead.py", []),
]
GPU_SECTION = "## GPU overhead"
FINE_NOISE = "unmarked (noise floor)"  # the noise-floor row of end_to_end.py's fine comparison


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (asked in a child: this process stays light)."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout.strip() == "True"


def run_one(script: str, args: list[str]) -> tuple[int | str, float, dict[str, Any]]:
    """(exit status or 'timeout', seconds, headline figures) of one benchmark."""
    start = time.monotonic()
    # Its own process group: a benchmark that runs over its time is stopped together with
    # the sidecars and producers it started.
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        stdout, stderr = process.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return "timeout", time.monotonic() - start, {}
    figures: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith(HEADLINE):
            figures = json.loads(line[len(HEADLINE) :])
    if process.returncode:
        sys.stderr.write(stdout[-4000:] + stderr[-4000:])
    return process.returncode, time.monotonic() - start, figures


def _fmt(
    figures: dict[str, dict[str, Any]], bench: str, key: str, show: Callable[[float], str]
) -> str:
    value = figures.get(bench, {}).get(key)
    return show(value) if isinstance(value, (int, float)) else "not measured"


def headline_rows(figures: dict[str, dict[str, Any]]) -> list[str]:
    """The headline table: figure, measured, target."""

    def ratio(v: float) -> str:
        return f"{v:.2f}×"

    def pct(v: float) -> str:
        return f"{v * 100:+.2f} %"

    def rate(v: float) -> str:
        return f"{v / 1e6:.2f} M records/s"

    rows = [
        (
            'natural marker (`with run.phase("forward")`) / bare timer',
            _fmt(figures, "markers_overhead", "natural_vs_bare", ratio),
            "≤ 2×",
        ),
        (
            "the same across three code layouts (min…max)",
            f"{_fmt(figures, 'markers_overhead', 'layouts_min', ratio)}…"
            f"{_fmt(figures, 'markers_overhead', 'layouts_max', ratio)}",
            "≤ 2×",
        ),
        (
            "loop driver step, C / Python: µs CPU per step warm (frames per step)",
            f"{_fmt(figures, 'driver_step', 'driver_c_us', lambda v: f'{v:.2f} µs')} "
            f"({_fmt(figures, 'driver_step', 'driver_c_frames', lambda v: f'{v:.1f}')}) / "
            f"{_fmt(figures, 'driver_step', 'driver_py_us', lambda v: f'{v:.2f} µs')} "
            f"({_fmt(figures, 'driver_step', 'driver_py_frames', lambda v: f'{v:.1f}')})",
            "",
        ),
        (
            "a marked step's markers with the caches cold: driver `next` + three phases",
            f"{_fmt(figures, 'cold_cache', 'cold_driver_us', lambda v: f'{v:.2f} µs')} + "
            f"{_fmt(figures, 'cold_cache', 'cold_phases_us', lambda v: f'{v:.2f} µs')}",
            "",
        ),
        (
            "MLP step: ours vs unmonitored (one thread, tools table)",
            _fmt(figures, "end_to_end", "mlp:ours", ratio),
            "",
        ),
        (
            "MLP step: TraceML 0.5 vs unmonitored",
            _fmt(figures, "end_to_end", "mlp:TraceML", ratio),
            "",
        ),
        (
            "MLP step: Lightning SimpleProfiler / torch.profiler vs unmonitored",
            f"{_fmt(figures, 'end_to_end', 'mlp:Lightning SimpleProfiler', ratio)} / "
            f"{_fmt(figures, 'end_to_end', 'mlp:torch.profiler', ratio)}",
            "",
        ),
        (
            "small CNN step: ours / TraceML vs unmonitored",
            f"{_fmt(figures, 'end_to_end', 'cnn:ours', ratio)} / "
            f"{_fmt(figures, 'end_to_end', 'cnn:TraceML', ratio)}",
            "",
        ),
    ]
    for threads in sorted(
        k.split(":")[1] for k in figures.get("end_to_end", {}) if k.startswith("slowdown:")
    ):
        rows.append(
            (
                f"MLP slowdown, {threads} torch thread(s), median of 7 pairs (noise floor)",
                f"{_fmt(figures, 'end_to_end', f'slowdown:{threads}', pct)} "
                f"({_fmt(figures, 'end_to_end', f'noise:{threads}', pct)})",
                "≤ 1 %",
            )
        )
        rows.append(
            (
                f"MLP slowdown, {threads} torch thread(s), fine comparison: 120 short "
                "pairs (noise floor)",
                f"{_fmt(figures, 'end_to_end', f'fine:{threads}:ours', pct)} ("
                f"{_fmt(figures, 'end_to_end', f'fine:{threads}:{FINE_NOISE}', pct)})",
                "≤ 1 %",
            )
        )
    rows.append(
        (
            "slowdown of a 1 / 10 / 100 ms step, `train_batches` + three phases (CPU time)",
            " / ".join(_fmt(figures, "step_sizes", f"ours_{ms}ms", pct) for ms in (1, 10, 100)),
            "",
        )
    )
    rows += [
        ("sidecar ingest, 1 producer", _fmt(figures, "ingest", "rate_1", rate), "≥ 2 M/s"),
        ("sidecar ingest, 4 producers", _fmt(figures, "ingest", "rate_4", rate), "≥ 1 M/s"),
        (
            "sidecar ingest, 8 producers (one node's ranks)",
            _fmt(figures, "ingest", "rate_8", rate),
            "≥ 1 M/s",
        ),
        (
            "ingest guard: whole path / decode alone, in process (records per CPU second of each)",
            f"{_fmt(figures, 'ingest', 'stage_ratio', ratio)} "
            f"({_fmt(figures, 'ingest', 'stage_whole', rate)} / "
            f"{_fmt(figures, 'ingest', 'stage_decode', rate)})",
            f"≥ {_fmt(figures, 'ingest', 'stage_floor', ratio)}",
        ),
        (
            "sidecar RSS: idle / peak over 10⁷ records",
            f"{_fmt(figures, 'ingest', 'rss_idle_mb', lambda v: f'{v:.0f} MB')} / "
            f"{_fmt(figures, 'ingest', 'rss_peak_mb', lambda v: f'{v:.0f} MB')}",
            "≤ 100 MB",
        ),
        (
            "sidecar CPU: idle / 1 run / 1 run unsampled / 8 ranks at 100 ms steps (8 fake "
            "GPUs, 1 s sampling)",
            " / ".join(
                _fmt(figures, "sidecar_footprint", key, lambda v: f"{v:.1f}")
                for key in ("idle_ms_s", "run_ms_s", "run_unsampled_ms_s", "ranks_ms_s")
            )
            + " ms/s",
            "",
        ),
        (
            "sidecar ingest with TensorBoard + MLflow + W&B exports / without (A/A noise floor)",
            f"{_fmt(figures, 'exports', 'ratio', ratio)} "
            f"({_fmt(figures, 'exports', 'floor', ratio)})",
            "",
        ),
        (
            "checkpoint write, num_measurements = 10⁵ (first write of a split, every row "
            "formatted)",
            f"{_fmt(figures, 'write_cap', 'seconds_top', lambda v: f'{v:.2f} s')} "
            f"({_fmt(figures, 'write_cap', 'first_top', lambda v: f'{v:.2f} s')})",
            "< 1 s",
        ),
    ]
    return [
        "| figure | measured | target |",
        "|---|---:|---|",
        *(f"| {name} | {value} | {target} |" for name, value, target in rows),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated script names to run (default: all)")
    args = parser.parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else None
    load_before = load_line()
    started = time.monotonic()
    gpu = cuda_available()
    statuses: list[str] = []
    figures: dict[str, dict[str, Any]] = {}
    for script, script_args in BENCHMARKS:
        if wanted is not None and script not in wanted:
            continue
        if script == "gpu_overhead.py" and not gpu:
            write_section(
                f"{GPU_SECTION}\n\nNot run: no GPU "
                f"(`python bench/run_all.py`, {time.strftime('%Y-%m-%d')}: torch "
                "sees no CUDA device). On a GPU machine `python bench/run_all.py` "
                "(or `python bench/gpu_overhead.py` alone, 1–2 minutes on an H200) "
                "fills this section.\n"
            )
            statuses.append(f"| {script} | not run (no CUDA) | |")
            continue
        print(f"run_all: {script} ...", flush=True)
        code, seconds, found = run_one(script, script_args)
        if found:
            figures[found.pop("bench")] = found
        state = "ok" if code == 0 else f"FAILED ({code})"
        statuses.append(f"| {script} | {state} | {seconds:.0f} |")
        print(f"run_all: {script} {state} in {seconds:.0f} s", flush=True)
    total_s = time.monotonic() - started
    text = "\n".join(
        [
            "## Summary",
            "",
            f"`python bench/run_all.py` on {platform.node()} ({os.cpu_count()} CPUs, "
            f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}), {time.strftime('%Y-%m-%d %H:%M %Z')}; "
            f"{total_s / 60:.1f} minutes in all. Other work ran on the machine meanwhile: "
            f"{load_before} before, {load_line()} after. Compare ratios "
            "measured side by side, not absolute times.",
            "",
            *headline_rows(figures),
            "",
            "| benchmark | status | seconds |",
            "|---|---|---:|",
            *statuses,
            "",
        ]
    )
    write_section(text, first=True)
    print(text)
    return 0 if all("FAILED" not in s for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
