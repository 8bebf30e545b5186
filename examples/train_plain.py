"""A plain PyTorch training script, with no monitoring: the starting point of
examples/train_instrumented.py, which differs from it by two lines (and the import).

    python examples/train_plain.py --epochs 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from train_demo import make_loaders


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

    for epoch in range(args.epochs):
        model.train()
        for features, labels in train_loader:
            optimizer.zero_grad()
            loss = loss_fn(model(features), labels)
            loss.backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for features, labels in val_loader:
                correct += int((model(features).argmax(dim=1) == labels).sum())
        print(
            f"epoch {epoch}: validation accuracy {correct / len(val_loader.dataset):.3f}",
            flush=True,
        )
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(args.out_dir) / "model.pt")


if __name__ == "__main__":
    main()
