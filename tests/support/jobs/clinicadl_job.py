"""A real clinicadl 2.0 ``Trainer`` on a synthetic BIDS folder (8x8x8 NIfTI volumes), with
the stock monitor or markers' one, for the clinicadl tests.

    python clinicadl_job.py ROOT TRUTH.json [--monitor stock|ours|alone|both] [...]

``both``: the stock monitor measures the same batches as markers' callback (switched on
again after ours switched it off); its table goes to ROOT/stock.tsv.

ROOT holds the BIDS folder (made once) and the MAPS folder ``maps``. The model sleeps a
known time in each step and records how long each of its steps took (the script's own
clock): ``forward``, ``backward``, ``optimization``, ``evaluation`` (lists of seconds, in
order); ``open`` and ``close``, the script's clock at each Trainer event just before and
just after markers' callback (``Stamps``); ``train_s`` (around each
``Trainer.train``/``resume`` call), and the ``warnings`` the Trainer's construction gave.

The torchvision build reachable here needs CUDA libraries for its C operators; clinicadl
imports torchvision only for model definitions, so the two operator schemas its Python
code registers against are declared first (not needed with a matching torchvision).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

_TORCHVISION = torch.library.Library("torchvision", "DEF")  # kept alive: the schemas live on
for _op in ("nms", "qnms"):
    _TORCHVISION.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import nibabel as nib  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from clinicadl.callbacks import Callback, TrainingCheckpointCallback  # noqa: E402
from clinicadl.callbacks import MonitorCallback as StockMonitor  # noqa: E402
from clinicadl.data.datasets import BidsDataset  # noqa: E402
from clinicadl.io.bids import BidsFileType  # noqa: E402
from clinicadl.models import SupervisedModel  # noqa: E402
from clinicadl.optim import OptimizationConfig  # noqa: E402
from clinicadl.optim.optimizers.config import SGDConfig  # noqa: E402
from clinicadl.split import Split  # noqa: E402
from clinicadl.train import ComputationalConfig, Trainer  # noqa: E402

from markers.integrations.clinicadl import MonitorCallback  # noqa: E402

SLEEP_S = {"forward": 0.02, "backward": 0.015, "optimization": 0.01, "evaluation": 0.015}
TRUTH: dict[str, Any] = {name: [] for name in SLEEP_S} | {"train_s": []}


def bids_folder(root: Path, subjects: int) -> tuple[Path, pd.DataFrame]:
    """A BIDS folder of ``subjects`` T1w images of 8x8x8 voxels, and its (participant,
    session, label) table."""
    bids = root / "bids"
    rows = []
    rng = np.random.default_rng(0)
    for i in range(subjects):
        sub = f"sub-{i:03d}"
        anat = bids / sub / "ses-M000" / "anat"
        image = anat / f"{sub}_ses-M000_T1w.nii.gz"
        if not image.exists():
            anat.mkdir(parents=True, exist_ok=True)
            volume = rng.random((8, 8, 8), dtype=np.float32)
            nib.save(nib.Nifti1Image(volume, np.eye(4)), image)
        rows.append({"participant_id": sub, "session_id": "ses-M000", "label": float(i % 2)})
    (bids / "dataset_description.json").write_text(
        json.dumps({"Name": "synthetic", "BIDSVersion": "1.7.0", "DatasetType": "raw"})
    )
    return bids, pd.DataFrame(rows)


class TimedModel(SupervisedModel):
    """A SupervisedModel whose steps sleep a known time and record their own duration."""

    def _timed(self, name: str, step: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = step(*args, **kwargs)
        time.sleep(SLEEP_S[name])
        TRUTH[name].append(time.perf_counter() - start)
        return result

    def forward_step(self, batch: Any) -> Any:
        return self._timed("forward", super().forward_step, batch)

    def backward_step(self, loss: Any, **kwargs: Any) -> Any:
        return self._timed("backward", super().backward_step, loss, **kwargs)

    def optimization_step(self, **kwargs: Any) -> Any:
        return self._timed("optimization", super().optimization_step, **kwargs)

    def evaluation_step(self, batch: Any) -> Any:
        return self._timed("evaluation", super().evaluation_step, batch)


class Stamps(Callback):
    """The script's clock at the Trainer's events: ``open`` placed before markers' callback
    (its stamps start the windows), ``close`` after it (its stamps end them), so each
    window holds the monitor's row. The opening one fails or sends Ctrl-C on request."""

    EVENTS = (
        "on_epoch_start",
        "on_epoch_end",
        "on_forward_step_start",
        "on_backward_step_start",
        "on_backward_step_end",
        "on_optimization_step_start",
        "on_optimization_step_end",
        "on_evaluation_step_start",
        "on_metrics_computation_start",
    )

    def __init__(self, name: str, raise_at: int = 0, interrupt_at: int = 0) -> None:
        self.stamps: dict[str, list[float]] = {event: [] for event in self.EVENTS}
        TRUTH[name] = self.stamps
        self.raise_at = raise_at
        self.interrupt_at = interrupt_at
        for event in self.EVENTS:
            setattr(self, event, self._stamper(event))

    def _stamper(self, event: str) -> Any:
        def stamp(**kwargs: Any) -> None:
            epoch = kwargs["state"].current_epoch
            if event == "on_epoch_start" and epoch == self.raise_at:
                raise RuntimeError(f"boom at epoch {self.raise_at}")
            if event == "on_epoch_start" and epoch == self.interrupt_at:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: a KeyboardInterrupt right here
            if kwargs["state"].called == "train":
                self.stamps[event].append(time.perf_counter())

        return stamp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("truth", type=Path)
    parser.add_argument(
        "--monitor", choices=("stock", "ours", "alone", "both", "off"), default="ours"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train", type=int, default=8, help="training subjects")
    parser.add_argument("--val", type=int, default=4, help="validation subjects")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--splits", type=int, default=1, help="splits trained on one Trainer")
    parser.add_argument("--raise-at-epoch", type=int, default=0)
    parser.add_argument("--interrupt-at-epoch", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="from_maps(...).resume(0)")
    args = parser.parse_args()

    bids, frame = bids_folder(args.root, args.train + args.val)
    file_type = BidsFileType(data_type="anat", suffix="T1w")
    train_data = frame.iloc[: args.train].reset_index(drop=True)
    val_data = frame.iloc[args.train :].reset_index(drop=True)

    def split(index: int) -> Split:
        result = Split(
            index=index,
            train_dataset=BidsDataset(bids, file_type, data=train_data, columns=["label"]),
            val_dataset=BidsDataset(bids, file_type, data=val_data, columns=["label"]),
        )
        result.build_train_loader(batch_size=args.batch, shuffle=False)
        result.build_val_loader(batch_size=args.batch)
        return result

    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(512, 1), torch.nn.Flatten(0))
    model = TimedModel(network=network, loss=torch.nn.MSELoss(), optimizer=SGDConfig(lr=0.01))
    callbacks: list[Callback] = [
        Stamps("open", args.raise_at_epoch, args.interrupt_at_epoch),
        TrainingCheckpointCallback(every_n_epochs=1),
    ]
    stock = StockMonitor(warmup_iterations=args.warmup)
    if args.monitor in ("stock", "both"):  # clinicadl moves it before every user callback
        callbacks.append(stock)
    if args.monitor != "stock":
        # "off": ours alone with enabled=False, which means no monitoring, as the stock's
        callbacks.append(
            MonitorCallback(warmup_iterations=args.warmup, enabled=args.monitor != "off")
        )
        if args.monitor == "ours":
            callbacks.append(StockMonitor(enabled=False))
    callbacks.append(Stamps("close"))
    maps = args.root / "maps"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.resume:
            trainer = Trainer.from_maps(maps, model=model, callbacks=callbacks)
        else:
            optimization = OptimizationConfig(
                num_epochs=args.epochs, accumulation_steps=args.accumulation
            )
            trainer = Trainer(maps, model=model, optimization=optimization, callbacks=callbacks)
    TRUTH["warnings"] = [str(w.message) for w in caught if "markers" in str(w.message)]
    if args.monitor == "both":  # ours switched it off: on again, measuring the same batches
        stock.config.enabled = True
    computational = ComputationalConfig(gpu=False, amp=False, channels_last=False)
    try:
        for index in range(args.splits):
            start = time.perf_counter()
            try:
                if args.resume:
                    trainer.resume(index)
                else:
                    trainer.train(split(index), computational=computational)
            finally:
                TRUTH["train_s"].append(time.perf_counter() - start)
    finally:
        args.truth.write_text(json.dumps(TRUTH))
    if args.monitor == "both":  # the stock monitor's table of the same run, beside ours
        stock._build_df().to_csv(args.root / "stock.tsv", sep="\t", index=False)
    sys.exit(0)


if __name__ == "__main__":
    main()
