"""A training script as a user writes one, for the across-process tests: k-fold splits,
resumes from the state file or from the user's own checkpoint, the user's own logger on
summary.log, ``sys.exit`` inside the run, batches of several shapes. No torch, so it
starts fast; tensors are stood in for by objects with a ``shape``.

It writes a progress file (JSON) at the end of every epoch and when done: epochs,
checkpoint answers and the slowest one, its own clock from the run's start to the end of
training (``elapsed_s``), the durations of its iterations as its own clock saw them and
how long ``finish()`` took (``finish_s``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import markers
import markers.run


class Tensor:
    """Something with a first dimension, as a tensor has."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape


def batch(shape: str, size: int) -> object:
    """One batch of ``size`` samples in the form ``shape``."""
    if shape == "tensor":
        return (Tensor(size, 3, 8, 8), Tensor(size))  # (inputs, labels)
    if shape == "tuples":  # collate_fn=lambda b: b over (image, label) samples
        return [(Tensor(3, 8, 8), 1) for _ in range(size)]
    if shape == "dicts":  # collate_fn=lambda b: b over dict samples: or collated fields?
        return [{"image": Tensor(3, 8, 8)} for _ in range(size)]
    return [[101, 7, 102] for _ in range(size)]  # token-id lists


def write_progress(path: Path | None, progress: dict) -> None:
    """Replace the progress file with ``progress``."""
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(progress))
        os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.005, help="seconds per iteration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cap", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per batch")
    parser.add_argument(
        "--give-batch-size",
        action="store_true",
        help="pass the batch size to start_run (else it is read)",
    )
    parser.add_argument(
        "--shape", choices=("tensor", "tuples", "tokens", "dicts"), default="tensor"
    )
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--state-in", type=Path, help="run.load_state_dict() from this file")
    parser.add_argument("--state-out", type=Path, help="save run.state_dict() per epoch")
    parser.add_argument(
        "--state-in-loop",
        type=int,
        default=-1,
        help="call run.state_dict() inside this iteration of epoch 0",
    )
    parser.add_argument("--fail-at-epoch", type=int, default=-1)
    parser.add_argument(
        "--interrupt-at",
        type=int,
        default=-1,
        help="Ctrl-C (SIGINT to itself) in this iteration of epoch 0, caught: "
        "training stops there, the script ends normally",
    )
    parser.add_argument("--exit", type=int, help="sys.exit(CODE) after the last epoch")
    parser.add_argument(
        "--user-log",
        action="store_true",
        help="log lines of our own into summary.log with a FileHandler",
    )
    parser.add_argument("--finish-timeout", type=float, help="markers' finish wait, seconds")
    parser.add_argument("--stop-file", type=Path, help="after the epochs, wait for it")
    parser.add_argument("--progress", type=Path)
    args = parser.parse_args()

    if args.finish_timeout is not None:
        markers.run.FINISH_TIMEOUT_S = args.finish_timeout
    size = args.batch_size if args.give_batch_size else None
    run = markers.start_run(
        out_dir=args.out_dir,
        split=args.split,
        warmup_iterations=args.warmup,
        num_measurements=args.cap,
        train_batch_size=size,
        val_batch_size=size,
        resume=args.resume,
    )
    started = time.perf_counter()
    if args.state_in is not None:
        run.load_state_dict(json.loads(args.state_in.read_text()))
    logger = logging.getLogger("user")
    if args.user_log:
        summary = Path(args.out_dir) / "training" / f"split-{args.split}" / "summary.log"
        summary.parent.mkdir(parents=True, exist_ok=True)
        logger.addHandler(logging.FileHandler(summary))
        logger.setLevel(logging.INFO)
    progress: dict = {
        "epochs": 0,
        "checkpoints_ok": 0,
        "max_checkpoint_s": 0.0,
        "iteration_s": [],
        "state_in_loop_s": 0.0,
        "pid": os.getpid(),
    }
    data = [batch(args.shape, args.batch_size)] * args.iters
    with run:
        for epoch in range(args.epochs):
            if epoch == args.fail_at_epoch:
                raise RuntimeError(f"boom in epoch {epoch}")
            with run.epoch():
                last = time.perf_counter()
                for i, _batch in enumerate(run.train_batches(data)):
                    with run.phase("forward"):
                        time.sleep(args.sleep)
                    if epoch == 0 and i == args.interrupt_at:
                        try:
                            os.kill(os.getpid(), signal.SIGINT)
                            time.sleep(10)
                        except KeyboardInterrupt:
                            progress["interrupted"] = True
                            break
                    if epoch == 0 and i == args.state_in_loop:
                        begin = time.perf_counter()
                        run.state_dict()
                        progress["state_in_loop_s"] = time.perf_counter() - begin
                    now = time.perf_counter()
                    progress["iteration_s"].append(now - last)
                    last = now
            logger.info("user line: epoch %d trained", epoch)
            begin = time.perf_counter()
            progress["checkpoints_ok"] += run.checkpoint()
            progress["max_checkpoint_s"] = max(
                progress["max_checkpoint_s"], time.perf_counter() - begin
            )
            logger.info("user line: epoch %d checkpointed", epoch)
            if args.state_out is not None:
                args.state_out.write_text(json.dumps(run.state_dict()))
            progress["epochs"] = epoch + 1
            write_progress(args.progress, progress)
            if progress.get("interrupted"):
                break
        progress["elapsed_s"] = time.perf_counter() - started
        write_progress(args.progress, progress)
        while args.stop_file is not None and not args.stop_file.exists():
            time.sleep(0.02)
        if args.exit is not None:
            sys.exit(args.exit)
        finishing = time.perf_counter()
    progress["finish_s"] = time.perf_counter() - finishing  # leaving the block: finish()
    write_progress(args.progress, progress)


if __name__ == "__main__":
    main()
