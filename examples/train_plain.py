"""A plain PyTorch training script, with no monitoring: the starting point of
examples/train_instrumented.py, which differs from it by two lines (and the import).

    python examples/train_plain.py --epochs 2
"""

from __future__ import annotations

from pathlib import Path

import torch
from synthetic import build, parse_args


def main() -> None:
    args = parse_args(__doc__)
    train_loader, val_loader, model, optimizer, loss_fn = build(args)

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
