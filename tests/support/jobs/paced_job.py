"""A marked training loop whose phases last set times, for the view tests (top, trace,
compare): data loading, forward, backward and optimization each sleep for their own time
but its last 2 ms, spun to the deadline (a sleeper is woken promptly on a busy machine,
where a spinning loop is stretched by whole time slices; the spin absorbs a late wake-up),
and the script writes down how long each forward and each step really
took on its own clock (``--truth``, JSON), so a test compares the monitor's figures with
the loop's own. ``--hold-file F``: after its epochs the loop goes on until F exists (a
live run a test can watch); ``--validate``: a validation pass per epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import markers


class Batch:
    """A batch with a first dimension, as a tensor has (so its size can be read)."""

    def __init__(self, size: int) -> None:
        self.shape = (size, 4)


SPIN_S = 0.002  # the end of a phase is spun, not slept: a wake-up comes late by up to this
spin_s = SPIN_S  # --spin-s: 0 sleeps whole phases (a loop that holds no CPU while it waits)


def spin(seconds: float) -> float:
    """Take ``seconds``; returns the time really spent, on the loop's own clock."""
    start = time.perf_counter()
    deadline = start + seconds
    time.sleep(max(0.0, seconds - spin_s))
    while time.perf_counter() < deadline:
        pass
    return time.perf_counter() - start


def batches(count: int, size: int, loading_s: float) -> Iterator[Batch]:
    """``count`` batches, each taking ``loading_s`` to load (``count`` < 0: endless)."""
    index = 0
    while index != count:
        spin(loading_s)
        yield Batch(size)
        index += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--loading-s", type=float, default=0.002)
    parser.add_argument("--forward-s", type=float, default=0.010)
    parser.add_argument("--backward-s", type=float, default=0.004)
    parser.add_argument("--optimization-s", type=float, default=0.002)
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--spin-s", type=float, default=SPIN_S, help="each phase's spun end")
    parser.add_argument("--truth", type=Path, help="the loop's own clock, written per epoch")
    parser.add_argument("--hold-file", type=Path, help="train on until this file exists")
    args = parser.parse_args()

    global spin_s
    spin_s = args.spin_s
    run = markers.start_run(
        out_dir=args.out_dir,
        warmup_iterations=args.warmup,
        num_measurements=args.cap,
        train_batch_size=args.batch_size,
        val_batch_size=args.batch_size,
    )
    truth: dict[str, object] = {"pid": os.getpid(), "forward_s": [], "step_s": []}
    forward_s: list[float] = truth["forward_s"]  # type: ignore[assignment]
    step_s: list[float] = truth["step_s"]  # type: ignore[assignment]
    epoch = 0
    with run:
        while epoch < args.epochs or (args.hold_file is not None and not args.hold_file.exists()):
            with run.epoch():
                last = time.perf_counter()
                for _ in run.train_batches(batches(args.iters, args.batch_size, args.loading_s)):
                    with run.phase("forward"):
                        forward_s.append(spin(args.forward_s))
                    with run.phase("backward"):
                        spin(args.backward_s)
                    with run.phase("optimization"):
                        spin(args.optimization_s)
                    now = time.perf_counter()
                    step_s.append(now - last)
                    last = now
                if args.validate:
                    with run.validation():
                        for _ in run.val_batches(batches(4, args.batch_size, args.loading_s)):
                            with run.phase("evaluation"):
                                spin(args.forward_s)
            run.checkpoint()
            epoch += 1
            if args.truth is not None:
                args.truth.write_text(json.dumps({**truth, "epochs": epoch}))


if __name__ == "__main__":
    main()
