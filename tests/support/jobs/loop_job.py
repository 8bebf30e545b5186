"""A training job for the fault tests: a plain Python loop with markers (no torch, so it
starts fast), driven by command-line options and by files the test creates.

It writes a progress file (JSON, replaced atomically) so a test can tell where it is:
iterations done, epochs, checkpoints answered, dropped records, its RSS, the slowest
iteration and the slowest checkpoint call.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import psutil

import markers


class Batch:
    """A batch with a first dimension, as a tensor has (so its size can be read)."""

    def __init__(self, size: int) -> None:
        self.shape = (size, 4)


def write_progress(path: Path | None, progress: dict) -> None:
    """Replace the progress file with ``progress``."""
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20, help="training batches per epoch")
    parser.add_argument("--val-iters", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.001, help="seconds per iteration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--unknown-batch-size",
        action="store_true",
        help="batches without a first dimension, no batch size given",
    )
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--state-out", type=Path, help="save run.state_dict() here per epoch")
    parser.add_argument("--state-in", type=Path, help="run.load_state_dict() from here")
    parser.add_argument("--raise-at-epoch", type=int, default=-1)
    parser.add_argument("--gpu", help="UUID:NAME: announce this GPU (stands in for CUDA)")
    parser.add_argument("--progress", type=Path)
    parser.add_argument("--burst-file", type=Path, help="while it exists: no sleep")
    parser.add_argument("--stop-file", type=Path, help="run epochs until it exists")
    args = parser.parse_args()

    started = time.monotonic()
    run = markers.start_run(
        out_dir=args.out_dir,
        split=0,
        warmup_iterations=args.warmup,
        num_measurements=args.cap,
        resume=args.resume,
        train_batch_size=None if args.unknown_batch_size else args.batch_size,
        val_batch_size=None if args.unknown_batch_size else args.batch_size,
    )
    if args.state_in is not None:
        run.load_state_dict(json.loads(args.state_in.read_text()))
    if args.gpu:
        uuid, name = args.gpu.split(":", 1)
        run._sender.send_control({"type": "gpu", "uuid": uuid, "name": name})
    batch = object() if args.unknown_batch_size else Batch(args.batch_size)
    process = psutil.Process()
    progress = {
        "iterations": 0,
        "epochs": 0,
        "checkpoints_ok": 0,
        "max_step_s": 0.0,
        "max_checkpoint_s": 0.0,
        "rss": process.memory_info().rss,
        "dropped": 0,
        "pid": os.getpid(),
        "done": False,
    }
    with run:
        epoch = 0
        while epoch < args.epochs or (args.stop_file and not args.stop_file.exists()):
            if epoch == args.raise_at_epoch:
                raise RuntimeError(f"boom in epoch {epoch}")
            with run.epoch():
                for _ in run.train_batches([batch] * args.iters):
                    step_start = time.perf_counter()
                    with run.phase("forward"):
                        sum(range(100))
                    with run.phase("backward"):
                        sum(range(100))
                    with run.phase("optimization"):
                        pass
                    progress["max_step_s"] = max(
                        progress["max_step_s"], time.perf_counter() - step_start
                    )
                    progress["iterations"] += 1
                    if args.burst_file is None or not args.burst_file.exists():
                        time.sleep(args.sleep)
                    if progress["iterations"] % 200 == 0:
                        progress["rss"] = process.memory_info().rss
                        progress["dropped"] = run.dropped
                        write_progress(args.progress, progress)
                with run.validation():
                    for _ in run.val_batches([batch] * args.val_iters):
                        with run.phase("evaluation"):
                            pass
                        with run.phase("metrics"):
                            pass
            checkpoint_start = time.perf_counter()
            progress["checkpoints_ok"] += run.checkpoint()
            progress["max_checkpoint_s"] = max(
                progress["max_checkpoint_s"], time.perf_counter() - checkpoint_start
            )
            if args.state_out is not None:
                args.state_out.write_text(json.dumps(run.state_dict()))
            epoch += 1
            progress["epochs"] = epoch
            progress["dropped"] = run.dropped
            progress["rss"] = process.memory_info().rss
            write_progress(args.progress, progress)
        # Training ends here; finish() (leaving the block) then waits for the sidecar's
        # final write, which the Training time does not include.
        progress["elapsed_s"] = time.monotonic() - started
    progress["done"] = True
    write_progress(args.progress, progress)


if __name__ == "__main__":
    main()
