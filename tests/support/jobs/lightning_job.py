"""A Lightning fit with known costs (tests/support/spin.py) monitored by MonitorCallback;
writes what each part really took to ``--truth`` (one JSON file per rank).

    python tests/support/jobs/lightning_job.py --truth t.json [--accumulation N]
        [--epochs E] [--batches B] [--devices 2] [--val-check-interval F]
        [--ckpt-dir D] [--resume CKPT] [--kill-at-step N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from markers.integrations.lightning import MonitorCallback
from tests.support.spin import SpinBatches, SpinNet, SpinSGD, Truth

COSTS = {"forward": 0.008, "backward": 0.006, "optimization": 0.004, "loading": 0.006, "val": 0.003}


class SpinModule(pl.LightningModule):
    """SpinNet trained with SpinSGD; validation runs the same forward."""

    def __init__(self, truth: Truth) -> None:
        super().__init__()
        self.truth = truth
        self.net = SpinNet(truth, COSTS["forward"], COSTS["backward"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        start = time.perf_counter()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.truth.seconds["training_step"].append(time.perf_counter() - start)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return SpinSGD(self.parameters(), self.truth, COSTS["optimization"])


class OuterClock:
    """The script's own clock at the hooks that open and close the monitor's windows: a
    window opens at the ``Before`` callback (listed before MonitorCallback, so it runs
    first) and closes at the ``After`` one (listed after it). Each window is written to
    the truth as ``outer_<part>``, one per batch (per step for optimization): an upper
    bound on the row, whatever the scheduling inside it."""

    def __init__(self, truth: Truth) -> None:
        self.truth = truth
        self.opened: dict[str, float] = {}
        self.loading_from = time.perf_counter()  # the last batch end, pass end or save

    def open(self, *parts: str) -> None:
        now = time.perf_counter()
        self.opened.update(dict.fromkeys(parts, now))

    def close(self, part: str) -> None:
        self.truth.seconds[f"outer_{part}"].append(time.perf_counter() - self.opened[part])

    def free(self) -> None:
        """Time from now on is the next training batch's data loading."""
        self.loading_from = time.perf_counter()


class Before(pl.Callback):
    """Opens the outer windows (runs before MonitorCallback)."""

    def __init__(self, clock: OuterClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.opened["loading"] = self.clock.loading_from
        self.clock.open("forward")

    def on_before_backward(self, *args: Any) -> None:
        self.clock.open("backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.clock.open("optimization")

    def on_train_batch_end(self, *args: Any) -> None:
        self.clock.free()

    def on_train_epoch_start(self, *args: Any) -> None:
        self.clock.free()

    def on_validation_end(self, *args: Any) -> None:
        self.clock.free()


class After(pl.Callback):
    """Closes the outer windows (runs after MonitorCallback)."""

    def __init__(self, clock: OuterClock) -> None:
        self.clock = clock
        self.stepped = False

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.close("loading")

    def on_before_backward(self, *args: Any) -> None:
        self.clock.close("forward")

    def on_after_backward(self, *args: Any) -> None:
        self.clock.close("backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.stepped = True

    def on_train_batch_end(self, *args: Any) -> None:
        if self.stepped:
            self.stepped = False
            self.clock.close("optimization")


class KillAtStep(pl.Callback):
    """SIGKILLs the process when a batch starts at ``step`` optimizer steps: after every
    save of the step before (ModelCheckpoint saves at the end of batches and passes)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--truth", required=True)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--val-batches", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--val-check-interval", type=float, default=1.0)
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--resume")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--forward-s", type=float, default=COSTS["forward"])
    args = parser.parse_args()
    COSTS["forward"] = args.forward_s

    torch.set_num_threads(1)
    truth = Truth()
    clock = OuterClock(truth)
    callbacks: list[pl.Callback] = [
        Before(clock),
        MonitorCallback(warmup_iterations=args.warmup),
        After(clock),
    ]
    if args.ckpt_dir:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=-1)
        )
    if args.kill_at_step:
        callbacks.append(KillAtStep(args.kill_at_step))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulation,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        val_check_interval=args.val_check_interval,
    )
    save = trainer.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        """A save, timed (``save``), ends the outer clock's data loading (the monitor cuts
        saves out; its own wrapper, put on in fit, wraps this one)."""
        start = time.perf_counter()
        try:
            return save(*args, **kwargs)
        finally:
            truth.seconds["save"].append(time.perf_counter() - start)
            clock.free()

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    trainer.fit(
        SpinModule(truth),
        train_dataloaders=SpinBatches(truth, args.batches, COSTS["loading"]),
        val_dataloaders=SpinBatches(truth, args.val_batches, COSTS["val"], "val"),
        ckpt_path=args.resume,
    )
    rank = trainer.global_rank
    path = args.truth if rank == 0 else f"{args.truth}.rank{rank}"
    with open(path, "w") as handle:
        json.dump({**truth.seconds, "pid": os.getpid()}, handle)


if __name__ == "__main__":
    main()
