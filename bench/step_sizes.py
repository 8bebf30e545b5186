"""Slowdown per step size: synthetic CPU steps of 1 ms, 10 ms and 100 ms (a small real
model whose forward also spins the CPU up to the step's length), marked against unmarked.

    python bench/step_sizes.py [--pairs-scale 1.0] [--no-write]

One torch thread, a real sidecar listening. Steps are timed in the CPU time of the
training thread (``time.thread_time``), the spin too: on a shared machine a step's wall
time mostly says how long the thread waited for a core, its CPU time what it ran (what
ZeroMQ's I/O thread and the sidecar do elsewhere is not counted). Each figure is the
median, over interleaved pairs of short blocks (each block summed up by its median
step), of ``marked / unmarked - 1``; the noise floor is the same with an unmarked block
in place of the marked one.

* *Plain loop*: ours (``run.train_batches`` + ``with run.phase(...)`` around forward,
  backward and optimization), ``markers.instrument()`` (its hooks put on and taken off
  outside the timed block) and Lightning's ``SimpleProfiler.profile(...)`` per phase.
* *Lightning loop*: a ``Trainer.fit`` per block, the step time read by a timing callback
  at each batch end (present in every variant): without a callback, with our
  ``MonitorCallback``, with ``profiler="simple"``.
* *TraceML 0.5*: ``traceml_ai.trace_step`` around each step under ``traceml run``, in its
  own process: its blocks after ``traceml.init()`` against plain blocks of the same
  process before it (it cannot be switched off again, so these are not interleaved).

Writes ``## Slowdown per step size``. A CPU spin stands for the GPU work of a real step:
what the markers add is per step, not per millisecond of step, so it shrinks as 1/step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import markers  # noqa: E402
from bench.common import headline, load_line, sidecar  # noqa: E402
from bench.end_to_end import (  # noqa: E402
    Block,
    marked_step,
    median_interval,
    pair_ratios,
    timed,
    traceml_report,
)
from bench.models import Workload, _workload  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402

thread_time = time.thread_time  # the training thread's CPU seconds
STEP_MS = (1, 10, 100)
# Per step size: steps per block (blocks of ~50-200 ms) and interleaved pairs.
BLOCK_STEPS = {1: 50, 10: 8, 100: 2}
PAIRS = {1: 40, 10: 16, 100: 6}
LIGHTNING_ROUNDS = 5
LIGHTNING_STEPS = {1: 60, 10: 12, 100: 4}


def spin_workload(step_ms: int) -> Workload:
    """A small MLP (32-32-10, batch 16) whose forward spins the CPU so that a whole
    unmarked step lasts ``step_ms``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    w = _workload(f"{step_ms} ms step", model, torch.randn(16, 32))
    model_forward = w.forward
    spin_s = [0.0]

    def forward() -> torch.Tensor:
        until = thread_time() + spin_s[0]
        while thread_time() < until:
            pass
        return model_forward()

    w.forward = forward
    spin_s[0] = max(0.0, step_ms / 1e3 - statistics.median(_seconds(w.step) for _ in range(50)))
    return w


def _seconds(step: Callable[[], None]) -> float:
    start = thread_time()
    step()
    return thread_time() - start


def cpu_timed(loop: Callable[[int], Iterable[object]], step: Callable[[], None]) -> Block:
    """``bench.end_to_end.timed`` on the training thread's CPU clock."""
    return timed(loop, step, thread_time)


def instrumented(w: Workload, run: markers.Run) -> Block:
    """Blocks of the plain loop with instrument()'s hooks on (put on and taken off
    outside the timed steps)."""
    plain = cpu_timed(w.batches, w.step)

    def block(n: int) -> list[float]:
        hooks = markers.instrument(w.model, w.optimizer, run)
        try:
            return plain(n)
        finally:
            hooks.remove()

    return block


def plain_loop(step_ms: int, run: markers.Run, scale: float) -> dict[str, list[float]]:
    """Per-pair ratios of each plain-loop variant against unmarked blocks."""
    from lightning.pytorch.profilers import SimpleProfiler

    base, hooked = spin_workload(step_ms), spin_workload(step_ms)
    variants = {
        "unmarked (noise floor)": cpu_timed(base.batches, base.step),
        "ours": cpu_timed(
            lambda n: run.train_batches(base.batches(n)), marked_step(base, run.phase)
        ),
        "instrument()": instrumented(hooked, run),
        "Lightning SimpleProfiler": cpu_timed(
            base.batches, marked_step(base, SimpleProfiler().profile)
        ),
    }
    pairs = max(3, round(PAIRS[step_ms] * scale))
    return {
        name: pair_ratios(
            cpu_timed(base.batches, base.step),
            block,
            BLOCK_STEPS[step_ms],
            pairs,
            statistics.median,
        )
        for name, block in variants.items()
    }


def lightning_block(step_ms: int, steps: int, extra: dict[str, Any]) -> float:
    """Median step (s) of one ``Trainer.fit`` of ``steps`` spin steps (``extra``: the
    Trainer's callbacks and profiler), its first step left out."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    w = spin_workload(step_ms)
    ends: list[float] = []

    class Timing(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            ends.append(thread_time())

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return w.forward()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Timing(), *extra.get("callbacks", [])],
        profiler=extra.get("profiler"),
    )
    trainer.fit(Module(), DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1))
    return statistics.median(b - a for a, b in pairwise(ends[1:]))


def lightning_loop(step_ms: int, endpoint: str, scale: float) -> dict[str, list[float]]:
    """Per-round ratios of the Lightning variants against the round's fit without a
    callback (each round fits every variant once, the order rotated)."""
    from markers.integrations.lightning import MonitorCallback

    variants: dict[str, Callable[[], dict[str, Any]]] = {
        "plain": dict,
        "Lightning, no callback (noise floor)": dict,
        "ours: MonitorCallback": lambda: {
            "callbacks": [
                MonitorCallback(out_dir="lightning", warmup_iterations=0, endpoint=endpoint)
            ]
        },
        'Lightning profiler="simple"': lambda: {"profiler": "simple"},
    }
    names = list(variants)
    out: dict[str, list[float]] = {name: [] for name in names[1:]}
    for round_ in range(max(2, round(LIGHTNING_ROUNDS * scale))):
        shift = round_ % len(names)
        step_s = {
            name: lightning_block(step_ms, LIGHTNING_STEPS[step_ms], variants[name]())
            for name in names[shift:] + names[:shift]
        }
        for name in out:
            out[name].append(step_s[name] / step_s["plain"] - 1)
    return out


def traceml_worker(step_ms: int, pairs: int) -> None:
    """Inside ``traceml run``: plain blocks, then ``traceml.init()`` and traced blocks."""
    import traceml_ai as traceml

    torch.set_num_threads(1)
    w = spin_workload(step_ms)
    steps = BLOCK_STEPS[step_ms]
    plain = cpu_timed(w.batches, w.step)
    plain(steps)
    before = [statistics.median(plain(steps)) for _ in range(pairs)]
    traceml.init()

    def traced_step() -> None:
        with traceml.trace_step(w.model):
            w.step()

    traced = cpu_timed(w.batches, traced_step)
    traced(steps)
    after = [statistics.median(traced(steps)) for _ in range(pairs)]
    print("TRACEML " + json.dumps({"before": before, "traced": after}), flush=True)


def traceml_ratio(step_ms: int, pairs: int) -> dict[str, Any]:
    """TraceML's slowdown from its own process (medians), or the reason it is missing."""
    found = traceml_report(
        __file__, ["traceml-worker", "--step-ms", str(step_ms), "--pairs", str(pairs)]
    )
    if "error" in found:
        return found
    return {"ratio": statistics.median(found["traced"]) / statistics.median(found["before"]) - 1}


def _cell(ratios: list[float] | None) -> str:
    if not ratios:
        return "—"
    low, high = median_interval(ratios)
    return f"{statistics.median(ratios) * 100:+.2f} % ({low * 100:+.1f}…{high * 100:+.1f})"


def section(results: dict[int, dict[str, Any]], seconds: float) -> tuple[str, dict]:
    """The ``## Slowdown per step size`` section and its headline figures."""
    rows = [
        "unmarked (noise floor)",
        "ours",
        "instrument()",
        "Lightning SimpleProfiler",
        "Lightning, no callback (noise floor)",
        "ours: MonitorCallback",
        'Lightning profiler="simple"',
        "TraceML 0.5",
    ]
    lines = [
        "## Slowdown per step size",
        "",
        machine_line("python bench/step_sizes.py") + f" {load_line()} at the end; "
        f"{seconds / 60:.1f} minutes. One torch thread; each step a small MLP plus a "
        "CPU spin up to the step's length; a real sidecar listening. Cells: median "
        "over interleaved pairs of short blocks of `variant / unmarked - 1` (each "
        "block its median step, in the training thread's CPU time), a "
        "distribution-free ~95 % interval of that median beside it. TraceML runs in "
        "its own process, before/after, not interleaved.",
        "",
        "| variant | " + " | ".join(f"{ms} ms step" for ms in STEP_MS) + " |",
        "|---|" + "---:|" * len(STEP_MS),
    ]
    for row in rows:
        cells = []
        for ms in STEP_MS:
            if row == "TraceML 0.5":
                found = results[ms]["traceml"]
                cells.append(
                    f"{found['ratio'] * 100:+.2f} %"
                    if "ratio" in found
                    else f"not measured: {found['error']}"
                )
            else:
                cells.append(_cell(results[ms]["ratios"].get(row)))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "- what the markers add is a few µs per step whatever its length: a "
        "figure inside its noise floor's interval cannot be told from it",
        "",
    ]
    figures = {f"ours_{ms}ms": statistics.median(results[ms]["ratios"]["ours"]) for ms in STEP_MS}
    return "\n".join(lines), figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "traceml-worker"])
    parser.add_argument("--step-ms", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument(
        "--pairs-scale",
        type=float,
        default=1.0,
        help="multiply every pair count (shorter or steadier runs)",
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.mode == "traceml-worker":
        traceml_worker(args.step_ms, args.pairs)
        return 0
    start = time.perf_counter()
    torch.set_num_threads(1)
    results: dict[int, dict[str, Any]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp,
        sidecar(Path(tmp)) as (endpoint, _),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        run = markers.start_run(out_dir="steps", warmup_iterations=0, endpoint=endpoint)
        assert isinstance(run, markers.Run)  # a sidecar listens: not the no-op run
        for ms in STEP_MS:
            ratios = plain_loop(ms, run, args.pairs_scale)
            ratios |= lightning_loop(ms, endpoint, args.pairs_scale)
            results[ms] = {"ratios": ratios}
        run.finish()
    for ms in STEP_MS:
        results[ms]["traceml"] = traceml_ratio(ms, max(3, round(6 * args.pairs_scale)))
    text, figures = section(results, time.perf_counter() - start)
    print(text)
    if not args.no_write:
        write_section(text)
    headline("step_sizes", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
