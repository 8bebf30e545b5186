"""Step-time overhead of GPU phase timing: unmarked vs GpuTimer vs a synchronizing monitor.

    python bench/gpu_overhead.py [--repeats 15] [--steps 40]

Models (no torchvision): a small ResNet-like CNN at batch 64 (128 px, and 32 px where the
loop is bound by kernel launches, the worst case for any host-side cost), and a
pre-norm transformer block. Each model runs these variants side by side, interleaved in a
shuffled order in every repeat; the figure is the median step time over repeats:

* ``unmarked``: the plain training step;
* ``ours``: GpuTimer begin/end around forward, backward and optimization, and a poll of
  the pending slots' resolved prefix every step, as the Run does (peak_memory="bound");
* ``ours, no mem``: the same with peak_memory="off" (events only);
* ``sync monitor``: the reference's approach, torch.cuda.synchronize() + perf_counter at
  every phase stop;
* ``ours, natural``: the way users write it: ``for batch in run.train_batches(...)`` and
  ``with run.phase("forward"):`` (etc.) of a real Run reporting to a real sidecar process
  (GpuPhase once CUDA is up; the buffer's sends included).

A block of steps is timed from perf_counter before its first step to a synchronize after
its last one, for every variant alike. With CUDA the table replaces the section
``## GPU overhead`` of bench/RESULTS.md. Without CUDA it says so, runs the models for two
steps on the CPU as a smoke check, and exits 0 without writing numbers.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections import deque
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import markers  # noqa: E402
from bench.common import sidecar  # noqa: E402
from bench.results import RESULTS, write_section  # noqa: E402
from markers.gpu import GpuTimer, open_gpu_timer  # noqa: E402

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
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    """ResNet-18-shaped: a stem, four stages of two basic blocks, a linear head."""

    def __init__(self, classes: int = 100, width: int = 64, stem_stride: int = 1) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, stem_stride, 1, bias=False),
                                  nn.BatchNorm2d(w),
                                  nn.ReLU(inplace=True))
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
        self.block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0,
                                                batch_first=True, norm_first=True)
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


def plain_step(model, opt, x, y) -> None:
    loss = loss_of(model, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


class OursMonitor:
    """What the Run does per phase: wall stamps, a GpuTimer slot, a FIFO polled at flush."""

    def __init__(self, timer: GpuTimer) -> None:
        self.timer = timer
        self.pending: deque = deque()
        self.resolved = 0
        self.stamps: list[int] = []

    def step(self, model, opt, x, y) -> None:
        timer, pending, now = self.timer, self.pending, time.perf_counter_ns
        t0 = now()
        s = timer.begin()
        loss = loss_of(model, x, y)
        timer.end(s)
        pending.append((s, t0, now()))
        t0 = now()
        s = timer.begin()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        timer.end(s)
        pending.append((s, t0, now()))
        t0 = now()
        s = timer.begin()
        opt.step()
        timer.end(s)
        pending.append((s, t0, now()))
        poll = timer.poll
        while pending and poll(pending[0][0]) is not None:  # the flush: resolved prefix only
            pending.popleft()
            self.resolved += 1

    def settle(self) -> None:
        """After a timed block (the GPU is idle then): take the rest out of the pool."""
        res = self.timer.drain([p[0] for p in self.pending], timeout_s=10.0)
        self.resolved += sum(r is not None for r in res)
        self.pending.clear()


class SyncMonitor:
    """The reference's approach: synchronize the device at every phase stop."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def step(self, model, opt, x, y) -> None:
        sync, now, times = torch.cuda.synchronize, time.perf_counter, self.times
        t0 = now()
        loss = loss_of(model, x, y)
        sync()
        times.append(now() - t0)
        t0 = now()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync()
        times.append(now() - t0)
        t0 = now()
        opt.step()
        sync()
        times.append(now() - t0)
        del times[:-300]


def natural_block(run, model, opt, x, y, steps: int) -> float:
    """Seconds per step of ``steps`` steps marked as users write it, launch to completion."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in run.train_batches(range(steps)):
        with run.phase("forward"):
            loss = loss_of(model, x, y)
        with run.phase("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with run.phase("optimization"):
            opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def time_block(step, model, opt, x, y, steps: int) -> float:
    """Seconds per step over a block of ``steps`` steps, from launch to completion."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(model, opt, x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def run_case(name: str, repeats: int, steps: int, rng: random.Random, run) -> dict:
    label, model, opt, x, y = make_case(name, "cuda", small=False)
    ours = OursMonitor(open_gpu_timer(pool_size=256, peak_memory="bound"))
    ours_off = OursMonitor(open_gpu_timer(pool_size=256, peak_memory="off"))
    sync = SyncMonitor()
    variants = {
        "unmarked": (plain_step, None),
        "ours": (ours.step, ours),
        "ours, no mem": (ours_off.step, ours_off),
        "sync monitor": (sync.step, None),
        "ours, natural": (None, None),
    }

    def block(key: str, n: int, case=(model, opt, x, y)) -> float:
        step, _ = variants[key]
        if step is None:
            return natural_block(run, *case, n)
        return time_block(step, *case, n)

    for key, (_, mon) in variants.items():  # warm up every path: cuDNN, caches, pools
        block(key, max(5, steps // 4))
        if mon is not None:
            mon.settle()
    per_step: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for _ in range(repeats):
        rng.shuffle(order)
        for key in order:
            _, mon = variants[key]
            per_step[key].append(block(key, steps))
            if mon is not None:
                mon.settle()
    med = {k: statistics.median(v) for k, v in per_step.items()}
    spread = {k: (max(v) - min(v)) / med[k] for k, v in per_step.items()}
    dropped = ours.timer.dropped + ours_off.timer.dropped
    del block, model, opt, x, y
    torch.cuda.empty_cache()
    return {"label": label, "median": med, "spread": spread, "dropped": dropped,
            "inexact": ours.timer.inexact_peaks, "resolved": ours.resolved}


def host_cost_per_phase(peak_memory: str, n: int = 2000) -> float:
    """Microseconds of host time for begin+end+poll of one phase, with the GPU idle."""
    timer = open_gpu_timer(pool_size=256, peak_memory=peak_memory)
    batch = 200
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(n // batch):
        t0 = time.perf_counter()
        slots = []
        for _ in range(batch):
            s = timer.begin()
            timer.end(s)
            slots.append(s)
        t1 = time.perf_counter()
        torch.cuda.synchronize()  # outside the timed part: let the events complete
        t2 = time.perf_counter()
        for s in slots:
            assert timer.poll(s) is not None
        total += (t1 - t0) + (time.perf_counter() - t2)
    return total / (n // batch * batch) * 1e6


# ---- output ---------------------------------------------------------------------------


def table(results: list[dict], args, host_us: dict[str, float], wall_s: float) -> str:
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
        "`ours` = GpuTimer events + allocator reads (peak_memory=\"bound\") around "
        "forward, backward and optimization, with the Run's per-step poll; `no mem` = "
        "peak_memory=\"off\"; `sync` = torch.cuda.synchronize() + perf_counter at every "
        "phase stop (the reference's approach).",
        "",
        "| model | unmarked ms | ours ms | ours | ours, no mem | ours, natural | sync ms | "
        "sync | spread (unmarked) | dropped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["median"]
        base = m["unmarked"]

        def pct(k, base=base, m=m):
            return f"{(m[k] / base - 1) * 100:+.2f} %"

        lines.append(
            f"| {r['label']} | {base * 1e3:.3f} | {m['ours'] * 1e3:.3f} | {pct('ours')} | "
            f"{pct('ours, no mem')} | {pct('ours, natural')} | {m['sync monitor'] * 1e3:.3f} | "
            f"{pct('sync monitor')} "
            f"| {r['spread']['unmarked'] * 100:.1f} % | {r['dropped']} |")
    lines += [
        "",
        f"Host cost of one marked phase (begin + end + poll, GPU idle): "
        f"{host_us['bound']:.1f} µs with allocator reads, {host_us['off']:.1f} µs events "
        "only. It is hidden while the GPU is the bottleneck and adds to the step where "
        "the loop is bound by kernel launches. Target for ours: ≤ 1 % slowdown.",
        "",
    ]
    return "\n".join(lines)


CASES = ("resnet-128px", "resnet-32px", "transformer")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=30, help="steps per timed block")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp, \
            sidecar(Path(tmp)) as (endpoint, _):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = markers.start_run(out_dir="gpu", warmup_iterations=0, endpoint=endpoint)
        try:
            return measure(args, run)
        finally:
            run.finish()


def measure(args: argparse.Namespace, run) -> int:
    """Every case with CUDA; without it a smoke check of the models and the natural loop."""
    if not torch.cuda.is_available():
        for name in CASES:  # smoke: the models, the step and the marked loop build and run
            _, model, opt, x, y = make_case(name, "cpu", small=True)
            for _ in range(2):
                plain_step(model, opt, x, y)
            for _ in run.train_batches(range(2)):
                with run.phase("forward"):
                    loss = loss_of(model, x, y)
                with run.phase("backward"):
                    loss.backward()
        print("gpu_overhead: CUDA is not available here, so there is nothing to measure; "
              "skipped (the models ran 2 CPU steps as a smoke check). No numbers written.")
        return 0

    t_start = time.perf_counter()
    torch.backends.cudnn.benchmark = True
    torch.cuda.init()
    rng = random.Random(1234)
    results = []
    for name in CASES:
        r = run_case(name, args.repeats, args.steps, rng, run)
        results.append(r)
        m = r["median"]
        print(f"{r['label']}: " + ", ".join(
            f"{k} {v * 1e3:.3f} ms ({(v / m['unmarked'] - 1) * 100:+.2f} %)"
            for k, v in m.items()) + f"; dropped {r['dropped']}", flush=True)
    host_us = {mode: host_cost_per_phase(mode) for mode in ("bound", "off")}
    print(f"host cost per phase: {host_us['bound']:.1f} µs (bound), "
          f"{host_us['off']:.1f} µs (off)")
    text = table(results, args, host_us, time.perf_counter() - t_start)
    print(text)
    if not args.no_write:
        write_section(text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
