"""Host cost of the allocator reads a phase makes in the default "bound" peak mode.

    python bench/gpu_memory_cost.py [--fake] [--reads 2000]

A phase reads the caching allocator's statistics twice (begin and end,
``markers.cuda.TorchCudaBackend.memory``). Printed on one line: µs per phase for those
two reads, and µs per call of the torch functions one might use instead
(``memory_stats_as_nested_dict``, ``max_memory_allocated``, ``memory_stats``), medians of
five rounds. On a CUDA device (at the current device, with some tensors allocated) the
figures are real; with ``--fake`` (or without CUDA) they come from
``tests/support/fake_cuda.FakeCuda``, a Python stand-in that builds a dict of the real
shape: a fake-path figure, of the right order only, labelled so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from markers.cuda import TorchCudaBackend  # noqa: E402


def per_call_us(fn: Callable[[], Any], reads: int) -> float:
    """Median over five rounds of the µs one call of ``fn`` takes."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(reads):
            fn()
        rounds.append((time.perf_counter_ns() - t0) / reads / 1000)
    return statistics.median(rounds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fake", action="store_true", help="measure on FakeCuda (no GPU)")
    ap.add_argument("--reads", type=int, default=2000, help="calls per round")
    args = ap.parse_args(argv)
    import torch

    if args.fake or not torch.cuda.is_available():
        from tests.support.fake_cuda import FakeCuda, fake_torch

        cuda: Any = FakeCuda(["Fake GPU"])
        cuda.alloc(64 << 20)
        module, device, label = fake_torch(cuda), 0, "fake-path figures (FakeCuda, no GPU)"
    else:
        torch.cuda.init()
        held = [torch.empty(n << 20, device="cuda") for n in (1, 8, 64)]  # noqa: F841
        module, device = torch, torch.cuda.current_device()
        cuda, label = torch.cuda, f"on {torch.cuda.get_device_name(device)}"
    backend = TorchCudaBackend(module, device)
    phase_us = 2 * per_call_us(backend.memory, args.reads)
    nested = per_call_us(lambda: cuda.memory_stats_as_nested_dict(device), args.reads)
    peak = per_call_us(lambda: cuda.max_memory_allocated(device), args.reads)
    flat = per_call_us(lambda: cuda.memory_stats(device), args.reads)
    print(
        f"{phase_us:.1f} µs per phase (2 reads); per call: memory_stats_as_nested_dict "
        f"{nested:.1f} µs, max_memory_allocated {peak:.1f} µs, memory_stats {flat:.1f} µs "
        f"({label})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
