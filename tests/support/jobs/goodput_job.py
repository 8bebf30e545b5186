"""A job made to have each kind of badput, that keeps its own clock of each part.

A plain loop with markers (no torch): a loader that sleeps (data-loading stall), a step
that sleeps, a validation pass inside the training loop every few iterations, a
``checkpoint`` phase after each epoch, warmup iterations; optionally two ranks in forked
processes that meet at a barrier in Backward (the all-reduce) with one rank slower in
Forward, and a death by SIGKILL some iterations after a checkpoint. Each rank writes its
own sums (``perf_counter``; the start-up from the kernel's process start time, its start
ticks against ``CLOCK_BOOTTIME``) to ``<clock>.<rank>.json`` after every iteration.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import markers


class Batch:
    """A batch with a first dimension, as a tensor has."""

    shape = (4, 4)


def _write(path: Path, clock: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(clock))
    os.replace(tmp, path)


def _process_start_unix() -> float:
    """This process's start (Unix s): its start ticks since boot (``/proc/self/stat``)
    against the boot clock read now."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot_s, unix = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
    return unix - (boot_s - ticks / os.sysconf("SC_CLK_TCK"))


def rank_main(args: argparse.Namespace, rank: int, barrier: Any) -> None:
    """One rank's splits, one after the other in this process (k-fold); each split's
    clock in ``<clock>.<rank>.json`` (split 0) or ``<clock>.split<k>.<rank>.json``, its
    start the process's (split 0) or its ``start_run``'s."""
    time.sleep(args.startup_s)  # the script's own set-up before start_run
    for split in range(args.splits):
        start_unix = _process_start_unix() if split == 0 else time.time()
        suffix = f".split{split}" if split else ""
        split_main(
            args, rank, barrier, split, start_unix, Path(f"{args.clock}{suffix}.{rank}.json")
        )
        time.sleep(args.between_s)


def split_main(
    args: argparse.Namespace, rank: int, barrier: Any, split: int, start_unix: float, path: Path
) -> None:
    """One rank's training loop of one split, started at ``start_unix``; its clock in
    ``path``."""
    run = markers.start_run(
        out_dir=args.out_dir,
        split=split,
        rank=rank,
        warmup_iterations=args.warmup,
        num_measurements=args.cap,
        train_batch_size=4,
        resume=args.resume,
        flops_per_batch=args.flops,
    )
    if args.gpu:  # stands in for CUDA: the run names this GPU
        uuid, name = args.gpu.split(":", 1)
        run._sender.send_control({"type": "gpu", "uuid": uuid, "name": name})  # type: ignore[union-attr]
    clock = {
        "pid": os.getpid(),
        "process_start_unix": start_unix,
        "first_iteration_unix": None,
        "warmup": 0.0,
        "data_stall": 0.0,
        "validation": 0.0,
        "checkpoint": 0.0,
        "productive": 0.0,
        "straggler": 0.0,
        "iterations": 0,
        "checkpoint_unix": None,
        "end_unix": None,
    }
    stamps: list[float] = []

    def loader() -> Iterator[Batch]:
        for _ in range(args.iters):
            stamps.append(time.perf_counter())
            clock["fetch_unix"] = time.time()
            if clock["first_iteration_unix"] is None:
                clock["first_iteration_unix"] = time.time()
            time.sleep(args.data_s)
            fetched.append(time.perf_counter() - stamps[-1])
            yield Batch()
        stamps.append(time.perf_counter())

    done = 0  # iterations through the network, this process
    after_checkpoint = -1
    with run:
        for epoch in range(args.epochs):
            stamps.clear()
            fetched: list[float] = []
            away: list[float] = []  # per iteration: validation inside it
            waited: list[float] = []
            with run.epoch():
                for _ in run.train_batches(loader()):
                    with run.phase("forward"):
                        time.sleep(args.step_s + (args.slow_s if rank == args.slow_rank else 0.0))
                    with run.phase("backward"):
                        began = time.perf_counter()
                        if barrier is not None:
                            barrier.wait()
                        waited.append(time.perf_counter() - began)
                        time.sleep(args.step_s / 2)
                    with run.phase("optimization"):
                        pass
                    away.append(0.0)
                    if args.val_every and (done + 1) % args.val_every == 0:
                        began = time.perf_counter()
                        with run.validation():
                            for _ in run.val_batches([Batch()] * args.val_iters):
                                with run.phase("evaluation"):
                                    time.sleep(args.val_s)
                        away[-1] = time.perf_counter() - began
                        clock["validation"] += away[-1]
                    done += 1
                    if after_checkpoint >= 0:
                        after_checkpoint += 1
                        if after_checkpoint == args.die_after:
                            # dies inside a phase: its record and those still in the
                            # markers' buffer die too; the work since the checkpoint
                            # ends at the death
                            with run.phase("forward"):
                                time.sleep(0.3)
                                clock["death_unix"] = time.time()
                                _write(Path(f"{path}.death"), clock)
                                os.kill(os.getpid(), signal.SIGKILL)
            walls = [b - a for a, b in pairwise(stamps)]
            for index, wall in enumerate(walls):
                wall -= away[index] if index < len(away) else 0.0
                if done - len(walls) + index < args.warmup:
                    clock["warmup"] += wall
                else:
                    clock["data_stall"] += fetched[index]
                    clock["straggler"] += waited[index] if args.slow_s else 0.0
                    clock["productive"] += (
                        wall - fetched[index] - (waited[index] if args.slow_s else 0.0)
                    )
                    clock["iterations"] += 1
            began = time.perf_counter()
            with run.phase("checkpoint"):
                time.sleep(args.checkpoint_s)
            clock["checkpoint"] += time.perf_counter() - began
            if args.checkpoint_at == epoch:
                clock["checkpoint_unix"] = time.time()
                _write(path, clock)  # the sums the checkpoint's state holds
                after_checkpoint = 0 if run.checkpoint() else -1
            clock["end_unix"] = time.time()
            _write(path, clock)
        time.sleep(args.pause_s)  # still running, sending nothing (a hung job)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--clock", required=True, help="prefix of the clock files")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cap", type=int, default=1000)
    parser.add_argument("--startup-s", type=float, default=0.0)
    parser.add_argument("--data-s", type=float, default=0.0)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--val-every", type=int, default=0)
    parser.add_argument("--val-iters", type=int, default=3)
    parser.add_argument("--val-s", type=float, default=0.01)
    parser.add_argument("--checkpoint-s", type=float, default=0.0)
    parser.add_argument(
        "--checkpoint-at", type=int, default=-1, help="run.checkpoint() after this epoch"
    )
    parser.add_argument(
        "--die-after",
        type=int,
        default=-1,
        help="SIGKILL itself this many iterations after the checkpoint",
    )
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--splits", type=int, default=1, help="splits one after the other")
    parser.add_argument("--between-s", type=float, default=0.0, help="sleep after each split")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--gpu", help="UUID:NAME: announce this GPU")
    parser.add_argument("--flops", type=float, help="flops_per_batch for start_run")
    parser.add_argument(
        "--pause-s",
        type=float,
        default=0.0,
        help="after the last epoch, before finish: sleep, sending nothing",
    )
    parser.add_argument("--slow-s", type=float, default=0.0, help="extra Forward seconds")
    args = parser.parse_args()
    if args.ranks == 1:
        rank_main(args, 0, None)
        return
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(args.ranks)
    children = [
        context.Process(target=rank_main, args=(args, rank, barrier)) for rank in range(args.ranks)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join()
    raise SystemExit(max(child.exitcode or 0 for child in children))


if __name__ == "__main__":
    main()
