"""Cost of ``markers.instrument()`` on a real CPU training step, against the same loop
unmarked, marked by hand, and with torch's own hooks doing nothing.

    python bench/instrument_overhead.py [--repeats 31] [--steps 40] [--no-write]

The MLP step of bench/models.py (784-256-10, batch 64, one thread), in blocks of
``--steps`` steps. Each case runs next to an unmarked block (which of the two goes first
alternates), so the pair sees the machine in one state: unmarked again (the noise floor),
marked by hand (train_batches + three phases), torch's hooks alone (a no-op forward
pre-hook and forward hook on the model and no-op wrappers around
``torch.autograd.backward`` and ``optimizer.step``, the shape ``instrument()`` uses: what
no monitor built on these hooks can avoid), instrumented (``instrument()``'s hooks; put on
and taken off outside the timed block) and instrumented with the markers off
(``instrument`` given a ``NullRun``: it installs nothing). Then the same on a 1x1 linear
model, whose step costs next to nothing: what remains is the hooks' own cost. Each step
is timed on the wall clock and each block summed up by its median step (a descheduled
step moves it little); each block is also timed on the thread's CPU clock
(``time.thread_time``, per step), which a busy neighbour disturbs less. The figures are
medians over repeats, of the blocks and of the differences within each pair. Python
frames per step (``sys.setprofile`` calls) are counted too: unlike times, they do not
depend on the load. Writes ``## instrument() overhead`` into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import markers  # noqa: E402
from bench.common import load_line, sidecar  # noqa: E402
from bench.end_to_end import Block, ours, timed  # noqa: E402
from bench.models import mlp  # noqa: E402
from bench.results import machine_line, write_section  # noqa: E402

TARGET_S = 50e-6  # instrument()'s own cost per step, at most
IDEAL_SHARE = 0.01  # and ideally at most 1 % of the MLP step
FRAME_STEPS = 50  # steps whose Python frames are counted
Remove = Callable[[], None]
Case = tuple[Block, Callable[[], Remove] | None]  # a block and what it runs with
Samples = dict[str, list[tuple[float, float]]]  # (wall, CPU) per step by case


def tiny_case() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A step that costs next to nothing: what remains is the hooks' own cost."""
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(1, 1)

    def step() -> None:
        model(x).sum().backward()
        optimizer.step()  # looked up at each call, as a script does: instrument() wraps it
        optimizer.zero_grad()

    return model, optimizer, step


def noop_hooks(model: nn.Module, optimizer: torch.optim.Optimizer) -> Remove:
    """Torch's part of ``instrument()``'s cost: the same hooks and wrappers, doing nothing
    (a forward pre-hook with kwargs and a forward hook on ``model``, a wrapper around
    ``torch.autograd.backward`` and a bound-method wrapper of ``optimizer.step``). Returns
    the function that takes them off."""

    def noop(*args: Any) -> None:
        return None

    handles = [
        model.register_forward_pre_hook(noop, with_kwargs=True),
        model.register_forward_hook(noop),
    ]
    original = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    previous = optimizer.step

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return previous(*args, **kwargs)

    torch.autograd.backward = backward
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def remove() -> None:
        for handle in handles:
            handle.remove()
        torch.autograd.backward = original
        del optimizer.step

    return remove


def measured(block: Block, steps: int, install: Callable[[], Remove] | None) -> tuple[float, float]:
    """(median step, thread-CPU seconds per step) of one block of ``steps`` steps, with
    the hooks ``install`` puts on (taken off after the block, outside its times)."""
    remove = install() if install is not None else None
    try:
        start_cpu = time.thread_time()
        times = block(steps)
        return statistics.median(times), (time.thread_time() - start_cpu) / steps
    finally:
        if remove is not None:
            remove()


def frames_per_step(step: Callable[[], None], install: Callable[[], Remove] | None) -> float:
    """Python frames (function calls) per step, with the hooks ``install`` puts on."""
    remove = install() if install is not None else None
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    try:
        step()  # warm: first-call work is not a step's
        sys.setprofile(count)
        try:
            for _ in range(FRAME_STEPS):
                step()
        finally:
            sys.setprofile(None)
    finally:
        if remove is not None:
            remove()
    return calls / FRAME_STEPS


def paired(baseline: Case, cases: dict[str, Case], steps: int, repeat: int, into: Samples) -> None:
    """One repeat: each case in a block next to a block of ``baseline`` (which first
    alternates by repeat), so that both see the machine in the same state; appends
    (wall, CPU) of both and of their difference to ``into``."""
    for name, case in cases.items():
        pair = [("", baseline), (name, case)]
        for which, (block, install) in pair[::-1] if repeat % 2 else pair:
            into[which].append(measured(block, steps, install))
        (base_wall, base_cpu), (wall, cpu) = into[""][-1], into[name][-1]
        into[f"{name} - "].append((wall - base_wall, cpu - base_cpu))


def medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Median wall and median CPU seconds of (wall, CPU) samples."""
    return statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--steps", type=int, default=40, help="steps per timed block")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, sidecar(Path(tmp)) as (endpoint, _):
        run = markers.start_run(out_dir="bench", warmup_iterations=0, endpoint=endpoint)
        assert isinstance(run, markers.Run), "start_run did not monitor"
        workload = mlp()
        model, optimizer = workload.model, workload.optimizer

        def mlp_step() -> None:
            loss = workload.forward()
            workload.backward(loss)
            optimizer.step()  # looked up at each call, as a script does: instrument() wraps it

        tiny_model, tiny_optimizer, tiny_step = tiny_case()

        def instrumented(module: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], Remove]:
            return lambda: markers.instrument(module, opt, run).remove

        def markers_off() -> Remove:
            return markers.instrument(model, optimizer, markers.NullRun()).remove

        plain, tiny = timed(range, mlp_step), timed(range, tiny_step)
        groups: dict[str, tuple[Case, dict[str, Case]]] = {
            "mlp": (
                (plain, None),
                {
                    "unmarked again": (plain, None),
                    "marked by hand": (ours(workload, run), None),
                    "torch hooks alone (no-op)": (plain, lambda: noop_hooks(model, optimizer)),
                    "instrumented": (plain, instrumented(model, optimizer)),
                    "instrumented, markers off": (plain, markers_off),
                },
            ),
            "tiny": (
                (tiny, None),
                {
                    "torch hooks alone (no-op)": (
                        tiny,
                        lambda: noop_hooks(tiny_model, tiny_optimizer),
                    ),
                    "instrumented": (tiny, instrumented(tiny_model, tiny_optimizer)),
                },
            ),
        }
        samples: dict[str, Samples] = {group: defaultdict(list) for group in groups}
        for repeat in range(-1, args.repeats):  # repeat -1 warms up and is dropped
            for group, (baseline, cases) in groups.items():
                paired(baseline, cases, args.steps, repeat, samples[group])
            if repeat < 0:
                samples = {group: defaultdict(list) for group in groups}
        frames = {
            "unmarked": frames_per_step(mlp_step, None),
            "torch hooks alone (no-op)": frames_per_step(
                mlp_step, lambda: noop_hooks(model, optimizer)
            ),
            "instrumented": frames_per_step(mlp_step, instrumented(model, optimizer)),
        }
        run.finish()

    mlp_at = {name: medians(v) for name, v in samples["mlp"].items()}
    tiny_at = {name: medians(v) for name, v in samples["tiny"].items()}
    unmarked_s = mlp_at[""][0]

    def row(name: str) -> str:
        # The unmarked median plus the case's median difference from its neighbour: the
        # blocks' own medians drift with the machine more than the differences do.
        wall, cpu = mlp_at[""]
        more_wall, more_cpu = mlp_at[f"{name} - "] if name else (0.0, 0.0)
        return (
            f"| {name or 'unmarked'} | {(wall + more_wall) * 1e6:.0f} | "
            f"{more_wall / wall * 100:+.2f} % | {(cpu + more_cpu) * 1e6:.0f} |"
        )

    def extra(at: dict[str, tuple[float, float]], name: str) -> str:
        wall, cpu = at[f"{name} - "]
        return f"{wall * 1e6:.1f} µs wall, {cpu * 1e6:.1f} µs CPU"

    def frames_over(name: str) -> str:
        return f"{frames[name] - frames['unmarked']:+.0f}"

    ours_wall, ours_cpu = mlp_at["instrumented - "]
    met = max(ours_cpu, ours_wall) <= TARGET_S
    lines = [
        "## instrument() overhead",
        "",
        machine_line("python bench/instrument_overhead.py") + f" Blocks of {args.steps} "
        f"steps, each summed up by its median step, each case next to an unmarked block; "
        f"a case's row is the unmarked median plus the median of its {args.repeats} "
        f"differences from that block; one torch thread; {load_line()} at the end.",
        "",
        "| MLP 784-256-10, batch 64, CPU | per step (µs) | against unmarked | "
        "thread CPU per step (µs) |",
        "|---|---:|---:|---:|",
        *(
            row(name)
            for name in (
                "",
                "unmarked again",
                "marked by hand",
                "torch hooks alone (no-op)",
                "instrumented",
                "instrumented, markers off",
            )
        ),
        "",
        f"- instrumented against unmarked, MLP: **{extra(mlp_at, 'instrumented')}** per "
        f"step; torch's hooks alone (no-op): {extra(mlp_at, 'torch hooks alone (no-op)')}; "
        f"the noise floor (unmarked again): {extra(mlp_at, 'unmarked again')}",
        f"- the hooks alone (a 1x1 linear model, whose step costs "
        f"{tiny_at[''][0] * 1e6:.0f} µs): **{extra(tiny_at, 'instrumented')} per step**, "
        f"of which torch's no-op hooks and wrappers take "
        f"{extra(tiny_at, 'torch hooks alone (no-op)')} (the slow path of its module "
        "hooks: the floor of any monitor built on them)",
        f"- Python frames per MLP step: {frames['unmarked']:.0f} unmarked, "
        f"{frames_over('torch hooks alone (no-op)')} with torch's no-op hooks, "
        f"{frames_over('instrumented')} instrumented (a forward pre-hook and hook, the "
        "wrappers of backward() and step(), the six records of a step: its start, data "
        "loading, three phases, its end)",
        f"- against the target of at most {TARGET_S * 1e6:.0f} µs per step: "
        f"**{'met' if met else 'missed'}** in this run ({ours_cpu * 1e6:.0f} µs CPU, "
        f"{ours_wall * 1e6:.0f} µs wall); 1 % of this step would be "
        f"{IDEAL_SHARE * unmarked_s * 1e6:.0f} µs.",
        "- with the markers off (``start_run`` gave a ``NullRun``) ``instrument()`` "
        "installs nothing: the row above is the unmarked loop.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
