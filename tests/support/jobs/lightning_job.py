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
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from markers.integrations.lightning import MonitorCallback
from tests.support.spin import SpinBatches, SpinNet, SpinSGD, Truth

COSTS = {"forward": 0.008, "backward": 0.006, "optimization": 0.004, "loading": 0.006,
         "val": 0.003}


class SpinModule(pl.LightningModule):
    """SpinNet trained with SpinSGD; validation runs the same forward."""

    def __init__(self, truth: Truth) -> None:
        super().__init__()
        self.truth = truth
        self.net = SpinNet(truth, COSTS["forward"], COSTS["backward"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return SpinSGD(self.parameters(), self.truth, COSTS["optimization"])


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
    args = parser.parse_args()

    torch.set_num_threads(1)
    truth = Truth()
    callbacks: list[pl.Callback] = [MonitorCallback(warmup_iterations=args.warmup)]
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True,
                                                      save_top_k=-1))
    if args.kill_at_step:
        callbacks.append(KillAtStep(args.kill_at_step))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto", max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulation, callbacks=callbacks, logger=False,
        enable_checkpointing=bool(args.ckpt_dir), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=1,
        val_check_interval=args.val_check_interval)
    trainer.fit(SpinModule(truth),
                train_dataloaders=SpinBatches(truth, args.batches, COSTS["loading"]),
                val_dataloaders=SpinBatches(truth, args.val_batches, COSTS["val"], "val"),
                ckpt_path=args.resume)
    rank = trainer.global_rank
    path = args.truth if rank == 0 else f"{args.truth}.rank{rank}"
    with open(path, "w") as handle:
        json.dump({**truth.seconds, "pid": os.getpid()}, handle)


if __name__ == "__main__":
    main()
