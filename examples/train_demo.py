"""Demo: a plain PyTorch training loop on synthetic data, with markers (CPU, ~30 s).

    sidecar run -- python examples/train_demo.py            # under a job sidecar
    python examples/train_demo.py                           # starts a private sidecar

Writes maps/training/split-0/{summary.log,logs/computational.tsv,...} and maps/run.json.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import markers


def make_loaders(n_train: int, n_val: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Synthetic 10-class problem on 784 features (MNIST-sized)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--train-samples", type=int, default=64 * 400)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    train_loader, val_loader = make_loaders(
        args.train_samples, args.train_samples // 4, args.batch_size
    )
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    run = markers.start_run(
        out_dir=args.out_dir,
        split=0,
        warmup_iterations=10,
        num_measurements=100,
        train_batch_size=args.batch_size,
        val_batch_size=args.batch_size,
    )
    with run:
        for epoch in range(args.epochs):
            with run.epoch():
                model.train()
                for features, labels in run.train_batches(train_loader):
                    with run.phase("forward"):
                        loss = loss_fn(model(features), labels)
                    with run.phase("backward"):
                        optimizer.zero_grad()
                        loss.backward()
                    with run.phase("optimization"):
                        optimizer.step()
                model.eval()
                correct = 0
                with run.validation(), torch.no_grad():
                    for features, labels in run.val_batches(val_loader):
                        with run.phase("evaluation"):
                            predictions = model(features).argmax(dim=1)
                        with run.phase("metrics"):
                            correct += int((predictions == labels).sum())
            print(
                f"epoch {epoch}: validation accuracy {correct / len(val_loader.dataset):.3f}",
                flush=True,
            )
            run.checkpoint()
    if run.out_dir is not None:
        split = run.out_dir / "training" / "split-0"
        print(
            f"\nfiles written by the sidecar: {split / 'summary.log'}, "
            f"{split / 'logs'}/{{computational,phases,resources}}.tsv, "
            f"{run.out_dir / 'run.json'}"
        )


if __name__ == "__main__":
    main()
