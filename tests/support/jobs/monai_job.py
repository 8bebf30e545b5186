"""A MONAI ``SupervisedTrainer`` with a ``SupervisedEvaluator`` (run by a
``ValidationHandler`` after every epoch) on synthetic dict data, monitored by
``markers.integrations.monai.MonitorHandler``, for the MONAI tests.

    python monai_job.py OUT TRUTH.json [--raise-at-epoch E] [--checkpoints DIR [--resume]]
                        [--custom-step]

The parts sleep known times and record how long they took (the script's own clock):
``forward`` (the network in training), ``backward`` (its backward pass), ``optimization``
(the optimizer's step), ``evaluation`` (the network in the evaluator), lists of seconds in
order; ``run_s`` around ``trainer.run``. With ``--checkpoints`` Ignite's ``Checkpoint``
saves the model, optimizer, trainer and handler after every epoch; ``--resume`` loads the
latest first. ``--custom-step``: the trainer's ``iteration_update`` is the script's own
step, which fires none of MONAI's ``IterationEvents``. ``warnings``: markers' warnings.
``open``/``close``: the script's clock at each engine event markers' handler uses
(``train.<event>``, ``eval.<event>``), stamped by a handler attached before markers' one
(``open``: its stamps start the windows) and one attached after it (``close``: its stamps
end them), so each window holds the monitor's row.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Events
from ignite.handlers import Checkpoint, DiskSaver
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.handlers import ValidationHandler

from markers.integrations.monai import MonitorHandler

SLEEP_S = {"forward": 0.02, "backward": 0.02, "optimization": 0.02, "evaluation": 0.02}
TRUTH: dict[str, Any] = {name: [] for name in SLEEP_S} | {"run_s": 0.0, "open": {}, "close": {}}
# The events that open and close markers' Forward, Backward, Optimization and Evaluation.
STAMPED = {
    "train": (
        Events.ITERATION_STARTED,
        IterationEvents.LOSS_COMPLETED,
        IterationEvents.BACKWARD_COMPLETED,
        IterationEvents.MODEL_COMPLETED,
    ),
    "eval": (Events.ITERATION_STARTED, IterationEvents.MODEL_COMPLETED),
}


class SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps a known time and records its duration."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        time.sleep(SLEEP_S["backward"])
        TRUTH["backward"].append(time.perf_counter() - start)
        return grad


class Network(torch.nn.Module):
    """A linear model on 8x8x8 volumes whose forward sleeps a known time."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(512, 1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.linear(image.flatten(1)).flatten()
        time.sleep(SLEEP_S["forward" if self.training else "evaluation"])
        TRUTH["forward" if self.training else "evaluation"].append(time.perf_counter() - start)
        return SlowBackward.apply(out) if self.training else out


class SlowSGD(torch.optim.SGD):
    """SGD whose step sleeps a known time and records its duration."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        start = time.perf_counter()
        result = super().step(closure)
        time.sleep(SLEEP_S["optimization"])
        TRUTH["optimization"].append(time.perf_counter() - start)
        return result


def stamp(engines: dict[str, Any], side: str) -> None:
    """Attach, to each engine, a handler that records the script's clock at each of its
    STAMPED events into ``TRUTH[side]["<engine>.<event>"]``."""
    for name, engine in engines.items():
        for event in STAMPED[name]:
            times = TRUTH[side].setdefault(f"{name}.{event.name}", [])
            engine.add_event_handler(event, lambda _engine, t=times: t.append(time.perf_counter()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("truth", type=Path)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--raise-at-epoch", type=int, default=0)
    parser.add_argument("--checkpoints", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--custom-step", action="store_true")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    data = [
        {"image": torch.rand(1, 8, 8, 8, generator=generator), "label": torch.tensor(i % 2.0)}
        for i in range(12)
    ]
    train_loader = DataLoader(Dataset(data[:8]), batch_size=2)
    val_loader = DataLoader(Dataset(data[8:]), batch_size=2)
    torch.manual_seed(0)
    network = Network()
    optimizer = SlowSGD(network.parameters(), lr=0.01)
    evaluator = SupervisedEvaluator(
        device=torch.device("cpu"), val_data_loader=val_loader, network=network
    )
    loss_function = torch.nn.MSELoss()

    def custom_step(engine: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """A user's own step: forward, loss, backward, step, and no IterationEvents."""
        network.train()
        optimizer.zero_grad()
        loss = loss_function(network(batch["image"]), batch["label"])
        loss.backward()
        optimizer.step()
        return {"loss": loss.item()}

    trainer = SupervisedTrainer(
        iteration_update=custom_step if args.custom_step else None,
        device=torch.device("cpu"),
        max_epochs=args.epochs,
        train_data_loader=train_loader,
        network=network,
        optimizer=optimizer,
        loss_function=loss_function,
        train_handlers=[ValidationHandler(interval=1, validator=evaluator)],
    )
    engines = {"train": trainer, "eval": evaluator}
    stamp(engines, "open")
    handler = MonitorHandler(out_dir=str(args.out), warmup_iterations=2).attach(trainer, evaluator)
    stamp(engines, "close")

    @trainer.on(Events.EPOCH_STARTED)
    def crash(engine: Any) -> None:
        if engine.state.epoch == args.raise_at_epoch:
            raise RuntimeError(f"boom at epoch {args.raise_at_epoch}")

    if args.checkpoints is not None:
        objects = {"network": network, "optimizer": optimizer, "trainer": trainer}
        objects["monitor"] = handler
        checkpoint = Checkpoint(objects, DiskSaver(args.checkpoints, require_empty=False))
        trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
        if args.resume:
            latest = max(args.checkpoints.glob("*.pt"), key=lambda p: p.stat().st_mtime)
            Checkpoint.load_objects(objects, torch.load(latest, weights_only=False))
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.run()
    finally:
        TRUTH["run_s"] = time.perf_counter() - start
        TRUTH["warnings"] = [str(w.message) for w in caught if "markers" in str(w.message)]
        args.truth.write_text(json.dumps(TRUTH))


if __name__ == "__main__":
    main()
