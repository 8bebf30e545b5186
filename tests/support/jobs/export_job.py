"""A training job for the export tests: a plain loop with markers (no torch unless it
logs its own scalars) that asks for exports, checkpoints after every epoch (or at one
step) and, when told, kills itself (SIGKILL) after a checkpoint or at a step, so that a
second process resumes from it."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import markers


class Batch:
    """A batch with a first dimension, as a tensor has (so its size can be read)."""

    def __init__(self, size: int) -> None:
        self.shape = (size, 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--val-iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.002)
    parser.add_argument("--export", help="comma-separated names; absent: the sidecar's")
    parser.add_argument("--tensorboard-dir")
    parser.add_argument("--mlflow-experiment")
    parser.add_argument("--mlflow-run", action="store_true", help="log into an active run")
    parser.add_argument("--wandb-run", help="start a W&B run of this project first")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-after-epoch", type=int, default=-1)
    parser.add_argument(
        "--checkpoint-at", type=int, help="checkpoint at this step only, not after epochs"
    )
    parser.add_argument("--kill-at", type=int, help="SIGKILL at the start of this step")
    parser.add_argument("--start-step", type=int, default=0, help="the step resumed at")
    parser.add_argument(
        "--hold-at", type=int, help="at this step: touch <pause-file>.reached, wait on .hold"
    )
    parser.add_argument("--own-writer", help="also log 'loss' with torch's SummaryWriter here")
    parser.add_argument(
        "--pause-file",
        type=Path,
        help="after epoch e: touch <it>.reached<e>, then wait while <it>.hold<e> exists",
    )
    args = parser.parse_args()
    if args.mlflow_run:
        import mlflow

        mlflow.start_run()
        mlflow.log_metric("loss", 1.0, step=0)
    if args.wandb_run:
        import wandb

        wandb.init(project=args.wandb_run).log({"loss": 1.0}, step=0)
    run = markers.start_run(
        out_dir=args.out_dir,
        warmup_iterations=args.warmup,
        num_measurements=args.cap,
        resume=args.resume,
        export=None if args.export is None else args.export.split(","),
        tensorboard_dir=args.tensorboard_dir,
        mlflow_experiment=args.mlflow_experiment,
    )
    writer = None
    if args.own_writer:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.own_writer)
    batch = Batch(8)
    step = args.start_step
    with run:
        for epoch in range(args.epochs):
            with run.epoch():
                for _ in run.train_batches([batch] * args.iters):
                    if step == args.kill_at:
                        if writer is not None:
                            writer.flush()
                        os.kill(os.getpid(), signal.SIGKILL)
                    if step == args.hold_at and args.pause_file is not None:
                        args.pause_file.with_suffix(".reached").touch()
                        while args.pause_file.with_suffix(".hold").exists():
                            time.sleep(0.05)
                    if writer is not None:
                        writer.add_scalar("loss", 1.0 / (step + 1), step)
                    with run.phase("forward"):
                        time.sleep(args.sleep)
                    with run.phase("backward"):
                        sum(range(200))
                    with run.phase("optimization"):
                        pass
                    step += 1
                    if step == args.checkpoint_at:
                        run.checkpoint()
                with run.validation():
                    for _ in run.val_batches([batch] * args.val_iters):
                        with run.phase("evaluation"):
                            pass
            if args.checkpoint_at is None:
                run.checkpoint()
            if epoch == args.kill_after_epoch:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.pause_file is not None:
                args.pause_file.with_suffix(f".reached{epoch}").touch()
                while args.pause_file.with_suffix(f".hold{epoch}").exists():
                    time.sleep(0.05)
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
