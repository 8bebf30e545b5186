"""The CPU training steps the end-to-end benchmarks run: an MLP (784-256-10, batch 64) and
a small CNN (two conv layers on 28×28 images, batch 64), each split into the three phases
a user marks (forward, backward, optimization)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Workload:
    """One model's training step, as three callables run in order (loss flows through)."""

    name: str
    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    optimize: Callable[[], None]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), what the step trains on

    def batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A loader of ``n`` batches, the step's own (inputs, labels) pair each time: the
        loop a script writes over a DataLoader, whose batches the loop driver reads the
        size of (a list: the loader itself costs next to nothing)."""
        return [self.batch] * n

    def step(self) -> None:
        """One unmarked training step."""
        loss = self.forward()
        self.backward(loss)
        self.optimize()


def _workload(name: str, model: nn.Module, inputs: torch.Tensor) -> Workload:
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    labels = torch.randint(0, 10, (inputs.shape[0],))
    loss_fn = nn.CrossEntropyLoss()

    def backward(loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss.backward()

    return Workload(
        name,
        lambda: loss_fn(model(inputs), labels),
        backward,
        optimizer.step,
        model,
        optimizer,
        (inputs, labels),
    )


def mlp() -> Workload:
    """MLP 784-256-10 at batch 64 (~0.6 ms per step on one core here)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    return _workload("MLP 784-256-10", model, torch.randn(64, 784))


def cnn() -> Workload:
    """A small CNN (conv 1→16→32, two poolings, a linear head) at batch 64 on 28×28."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    )
    return _workload("small CNN", model, torch.randn(64, 1, 28, 28))


WORKLOADS: dict[str, Callable[[], Workload]] = {"mlp": mlp, "cnn": cnn}
