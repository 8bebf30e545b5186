"""The examples' shared problem: a synthetic 10-class task on 784 features (MNIST-sized),
its command line, and the model, optimizer and loss the examples train."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Parts(NamedTuple):
    """What an example trains: loaders, model, optimizer and loss."""

    train_loader: DataLoader
    val_loader: DataLoader
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: nn.Module


def make_loaders(n_train: int, n_val: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders of ``n_train`` and ``n_val`` samples of the
    synthetic problem (class centers plus noise), seeded: every run sees the same data."""
    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 784, generator=generator)

    def dataset(n: int) -> TensorDataset:
        labels = torch.randint(0, 10, (n,), generator=generator)
        features = centers[labels] + 9.0 * torch.randn(n, 784, generator=generator)
        return TensorDataset(features, labels)

    return (
        DataLoader(dataset(n_train), batch_size=batch_size, shuffle=True),
        DataLoader(dataset(n_val), batch_size=batch_size),
    )


def parse_args(description: str | None) -> argparse.Namespace:
    """The examples' options: ``--out-dir``, ``--epochs``, ``--train-samples`` (validation:
    a quarter of it) and ``--batch-size``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-samples", type=int, default=64 * 400)
    parser.add_argument("--batch-size", type=int, default=64)
    return parser.parse_args()


def build(args: argparse.Namespace) -> Parts:
    """The loaders for ``args``, a 3-layer MLP, SGD with momentum and cross-entropy, all
    seeded."""
    torch.manual_seed(0)
    train_loader, val_loader = make_loaders(
        args.train_samples, args.train_samples // 4, args.batch_size
    )
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Parts(train_loader, val_loader, model, optimizer, nn.CrossEntropyLoss())
