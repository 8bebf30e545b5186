"""Step-time overhead of GPU phase timing through the product's whole path.

    python bench/gpu_overhead.py [--repeats 15] [--steps 30]

Models (no torchvision): a small ResNet-like CNN at batch 64 (128 px, and 32 px where the
loop is bound by kernel launches, the worst case for any host-side cost), and a
pre-norm transformer block. Each model runs these variants side by side, interleaved in a
shuffled order in every repeat; the figure is the median step time over repeats:

* ``unmarked``: the plain training step;
* ``ours``: the product as a user runs it: ``markers.start_run`` (with its private
  sidecar process listening), ``run.train_batches`` and ``run.phase`` around forward,
  backward and optimization, so the GPU timer, the record buffer, its flushes and the
  ZeroMQ sender are all in the measured step;
* ``sync monitor``: the reference's approach, torch.cuda.synchronize() + perf_counter at
  every phase stop.

A block of steps is timed from perf_counter before its first step to a synchronize after
its last one, for every variant alike. Before any timed block the timer's whole event
pool is recorded once, so torch's lazy creation of CUDA events is not counted in the
first block. The agreement gate compares like with like: after the timed blocks, ours
runs ``CHECK_STEPS`` more steps with CUDA events of the benchmark's own recorded around
each phase (just outside the markers' own), and the median GPU time ours wrote to
computational.tsv for those steps must agree with those events' median within 15 % per
phase; every phase's gap is printed. (The sync monitor's host time plus a synchronize
is shown for comparison only: when the GPU is behind, it measures the queue, not the
phase.) With CUDA the table replaces the section
``## GPU overhead`` of bench/RESULTS.md. Without CUDA it says so, runs the models and the
marked path for two steps on the CPU as a smoke check, and exits 0 without writing numbers.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import markers  # noqa: E402
from bench.results import RESULTS, write_section  # noqa: E402

SECTION = "## GPU overhead"


# ---- models -------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.short = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    """ResNet-18-shaped: a stem, four stages of two basic blocks, a linear head."""

    def __init__(self, classes: int = 100, width: int = 64, stem_stride: int = 1) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 3, stem_stride, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)
        )
        layers, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class TransformerModel(nn.Module):
    def __init__(self, d: int, heads: int, vocab: int = 1000) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def make_case(name: str, device: str, small: bool):
    """(label, model, optimizer, inputs, targets) of one benchmark case."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if name.startswith("resnet"):
        px = 32 if name == "resnet-32px" else 128
        batch, px, width = (4, 16, 8) if small else (64, px, 64)
        stem_stride = 1 if px <= 32 else 2  # CIFAR-style at 32 px, a strided stem above
        model = SmallResNet(width=width, stem_stride=stem_stride).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, 3, px, px, generator=g).to(device)
        y = torch.randint(0, 100, (batch,), generator=g).to(device)
        label = f"ResNet-like CNN, batch {batch}, {px}x{px}, fp32"
    else:
        batch, seq, d, heads = (2, 16, 64, 4) if small else (16, 512, 1024, 16)
        model = TransformerModel(d, heads).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, seq, d, generator=g).to(device)
        y = torch.randint(0, 1000, (batch, seq), generator=g).to(device)
        label = f"Transformer block, batch {batch}, seq {seq}, d {d}, {heads} heads, fp32"
    return label, model, opt, x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ---- the variants ---------------------------------------------------------------------

PHASES = ("forward", "backward", "optimization")
AGREEMENT = 0.15  # ours vs CUDA events around the same phases, relative, per phase median
CHECK_STEPS = 40


def plain_step(model, opt, x, y) -> None:
    loss = loss_of(model, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def plain_block(model, opt, x, y, steps: int) -> None:
    for _ in range(steps):
        plain_step(model, opt, x, y)


class Ours:
    """The product's path: a Run on a private sidecar, its loop helper and its phases."""

    def __init__(self, out_dir: Path) -> None:
        self.run = markers.start_run(
            out_dir=str(out_dir),
            warmup_iterations=0,
            num_measurements=1_000_000,
            train_batch_size=1,
        )
        self.phases = [self.run.phase(name) for name in PHASES]
        self.out_dir = out_dir
        for _ in self.run.train_batches(()):  # a loop start opens the GPU timer
            pass

    def block(self, model, opt, x, y, steps: int) -> None:
        forward, backward, optimization = self.phases
        for _ in self.run.train_batches(range(steps)):
            with forward:
                loss = loss_of(model, x, y)
            with backward:
                opt.zero_grad(set_to_none=True)
                loss.backward()
            with optimization:
                opt.step()

    def checked_block(self, model, opt, x, y, steps: int) -> dict[str, float]:
        """``steps`` marked steps with the benchmark's own CUDA events around each phase:
        the median seconds between them per phase (the work the markers' phase timed)."""
        forward, backward, optimization = self.phases
        pairs: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {
            name: [] for name in PHASES
        }

        def events(name: str) -> tuple[torch.cuda.Event, torch.cuda.Event]:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            pairs[name].append(pair)
            return pair

        for _ in self.run.train_batches(range(steps)):
            start, end = events("forward")
            start.record()
            with forward:
                loss = loss_of(model, x, y)
            end.record()
            start, end = events("backward")
            start.record()
            with backward:
                opt.zero_grad(set_to_none=True)
                loss.backward()
            end.record()
            start, end = events("optimization")
            start.record()
            with optimization:
                opt.step()
            end.record()
        torch.cuda.synchronize()
        return {
            name: statistics.median(a.elapsed_time(b) / 1e3 for a, b in pairs[name])
            for name in PHASES
        }

    def prime(self) -> None:
        """Record every pooled event once (torch creates a CUDA event at its first record),
        outside any timed block; then let the GPU catch up."""
        timer = self.run._buffer.gpu
        if timer is None:
            return
        slots = [timer.begin() for _ in range(timer.pool_size)]
        for slot in slots:
            timer.end(slot)
        torch.cuda.synchronize()
        timer.drain(slots, timeout_s=10.0)

    def gpu_medians_s(self, last: int) -> dict[str, float]:
        """Median GPU seconds per phase of the ``last`` iterations, from the
        computational.tsv the sidecar wrote."""
        self.run.finish()
        table = self.out_dir / "training" / "split-0" / "logs" / "computational.tsv"
        frame = pd.read_csv(table, sep="\t").tail(last)
        return {name: float(frame[f"{name.capitalize()} GPU (s)"].median()) for name in PHASES}


class SyncMonitor:
    """The reference's approach: synchronize the device at every phase stop."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {name: [] for name in PHASES}

    def block(self, model, opt, x, y, steps: int) -> None:
        sync, now, times = torch.cuda.synchronize, time.perf_counter, self.times
        for _ in range(steps):
            t0 = now()
            loss = loss_of(model, x, y)
            sync()
            times["forward"].append(now() - t0)
            t0 = now()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            sync()
            times["backward"].append(now() - t0)
            t0 = now()
            opt.step()
            sync()
            times["optimization"].append(now() - t0)

    def medians_s(self) -> dict[str, float]:
        return {name: statistics.median(v) for name, v in self.times.items()}


def time_block(block, model, opt, x, y, steps: int) -> float:
    """Seconds per step over a block of ``steps`` steps, from launch to completion."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    block(model, opt, x, y, steps)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def run_case(name: str, repeats: int, steps: int, rng: random.Random, work: Path) -> dict:
    label, model, opt, x, y = make_case(name, "cuda", small=False)
    ours = Ours(work / name)
    sync = SyncMonitor()
    variants = {"unmarked": plain_block, "ours": ours.block, "sync monitor": sync.block}
    for block in variants.values():  # warm up every path: cuDNN autotune, caches, pools
        time_block(block, model, opt, x, y, max(5, steps // 4))
    ours.prime()
    sync.times = {phase: [] for phase in PHASES}  # only the timed blocks count
    per_step: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for _ in range(repeats):
        rng.shuffle(order)
        for key in order:
            per_step[key].append(time_block(variants[key], model, opt, x, y, steps))
    events_s = ours.checked_block(model, opt, x, y, CHECK_STEPS)
    timer = ours.run._buffer.gpu
    dropped, inexact = timer.dropped, timer.inexact_peaks
    gpu_s = ours.gpu_medians_s(CHECK_STEPS)
    sync_s = sync.medians_s()
    med = {k: statistics.median(v) for k, v in per_step.items()}
    spread = {k: (max(v) - min(v)) / med[k] for k, v in per_step.items()}
    del model, opt, x, y
    torch.cuda.empty_cache()
    return {
        "label": label,
        "median": med,
        "spread": spread,
        "dropped": dropped,
        "inexact": inexact,
        "gpu_s": gpu_s,
        "events_s": events_s,
        "sync_s": sync_s,
        "records_dropped": ours.run.dropped,
    }


def host_cost_per_phase(n: int = 2000) -> float:
    """Microseconds of host time per marked phase on the whole path (enter, exit, the
    buffer's flushes and sends, the GPU polls), with the GPU idle between batches."""
    with tempfile.TemporaryDirectory() as folder:
        ours = Ours(Path(folder))
        ours.prime()
        phase = ours.phases[0]
        batch = 200
        total = 0.0
        for _ in range(n // batch):
            torch.cuda.synchronize()  # outside the timed part
            t0 = time.perf_counter()
            for _ in range(batch):
                with phase:
                    pass
            total += time.perf_counter() - t0
        ours.run.finish()
    return total / (n // batch * batch) * 1e6


# ---- output ---------------------------------------------------------------------------


def gaps(r: dict) -> dict[str, float]:
    """Per phase: the relative gap between ours' GPU time and the CUDA events' around it."""
    return {p: abs(r["gpu_s"][p] - r["events_s"][p]) / r["events_s"][p] for p in PHASES}


def agreement(r: dict) -> float:
    """The largest relative gap of ``gaps``."""
    return max(gaps(r).values())


def gap_line(r: dict) -> str:
    """Every phase: ours' median GPU ms, the events' and the gap."""
    return "; ".join(
        f"{p} {r['gpu_s'][p] * 1e3:.3f} vs {r['events_s'][p] * 1e3:.3f} ms "
        f"({gaps(r)[p] * 100:.1f} %)"
        for p in PHASES
    )


def table(results: list[dict], args, host_us: float, wall_s: float) -> str:
    dev = torch.cuda.get_device_properties(torch.cuda.current_device())
    lines = [
        SECTION,
        "",
        f"`python bench/gpu_overhead.py --repeats {args.repeats} --steps {args.steps}` on "
        f"{dev.name}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; {wall_s:.0f} s in all.",
        "",
        "Median step time over interleaved repeats (each a block of steps timed from the "
        "first launch to a synchronize after the last). Slowdown = median / unmarked − 1. "
        "`ours` = the whole product path: start_run with its sidecar process, "
        "run.train_batches and run.phase around forward, backward and optimization (GPU "
        "events, allocator reads, the record buffer, its flushes and the ZeroMQ sends); "
        "`sync` = torch.cuda.synchronize() + perf_counter at every phase stop (the "
        "reference's approach). `ours vs events` = the largest gap between the median GPU "
        f"time ours wrote for {CHECK_STEPS} more steps and the median of CUDA events "
        "recorded around the same phases in those steps (forward, backward, optimization; "
        "every phase below the table).",
        "",
        "| model | unmarked ms | ours ms | ours | sync ms | sync | ours vs events | "
        "spread (unmarked) | GPU times dropped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["median"]
        base = m["unmarked"]

        def pct(k, base=base, m=m):
            return f"{(m[k] / base - 1) * 100:+.2f} %"

        lines.append(
            f"| {r['label']} | {base * 1e3:.3f} | {m['ours'] * 1e3:.3f} | {pct('ours')} | "
            f"{m['sync monitor'] * 1e3:.3f} | {pct('sync monitor')} | "
            f"{agreement(r) * 100:.1f} % | {r['spread']['unmarked'] * 100:.1f} % | "
            f"{r['dropped']} |"
        )
    lines += ["", *(f"- {r['label']}: {gap_line(r)}" for r in results)]
    lines += [
        "",
        f"Host cost of one marked phase on the whole path (enter + exit, flushes, sends, "
        f"GPU polls; GPU idle): {host_us:.1f} µs. It is hidden while the GPU is the "
        "bottleneck and adds to the step where the loop is bound by kernel launches. "
        "Target for ours: ≤ 1 % slowdown.",
        "",
    ]
    return "\n".join(lines)


CASES = ("resnet-128px", "resnet-32px", "transformer")


def smoke_on_cpu(work: Path) -> None:
    """Without CUDA: the models and the marked path (Run, buffer, sender, sidecar) run two
    steps, so the script is known to work up to the GPU."""
    for name in CASES:
        _, model, opt, x, y = make_case(name, "cpu", small=True)
        plain_block(model, opt, x, y, 2)
        ours = Ours(work / name)
        ours.block(model, opt, x, y, 2)
        ours.run.finish()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=30, help="steps per timed block")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        if not torch.cuda.is_available():
            smoke_on_cpu(work)
            print(
                "gpu_overhead: CUDA is not available here, so there is nothing to measure; "
                "skipped (the models and the marked path ran 2 CPU steps as a smoke "
                "check). No numbers written."
            )
            return 0
        t_start = time.perf_counter()
        torch.backends.cudnn.benchmark = True
        torch.cuda.init()
        rng = random.Random(1234)
        results = []
        for name in CASES:
            r = run_case(name, args.repeats, args.steps, rng, work)
            results.append(r)
            m = r["median"]
            print(
                f"{r['label']}: "
                + ", ".join(
                    f"{k} {v * 1e3:.3f} ms ({(v / m['unmarked'] - 1) * 100:+.2f} %)"
                    for k, v in m.items()
                )
                + f"; ours vs events: {gap_line(r)}; "
                f"GPU times dropped {r['dropped']}, records dropped {r['records_dropped']}",
                flush=True,
            )
        host_us = host_cost_per_phase()
        print(f"host cost per marked phase: {host_us:.1f} µs")
        text = table(results, args, host_us, time.perf_counter() - t_start)
    print(text)
    bad = [r["label"] for r in results if agreement(r) > AGREEMENT]
    if bad:
        print(
            f"gpu_overhead: ours and the CUDA events around the same phases disagree by more than "
            f"{AGREEMENT:.0%} on: {', '.join(bad)}; RESULTS.md left alone",
            file=sys.stderr,
        )
        return 1
    if not args.no_write:
        write_section(text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
