"""Demo: a plain PyTorch training loop on synthetic data, with markers (CPU, ~30 s).

    sidecar run -- python examples/train_demo.py            # under a job sidecar
    python examples/train_demo.py                           # starts a private sidecar

Writes maps/training/split-0/{summary.log,logs/computational.tsv,...} and maps/run.json.
"""

from __future__ import annotations

import torch
from synthetic import build, parse_args

import markers


def main() -> None:
    args = parse_args(__doc__)
    train_loader, val_loader, model, optimizer, loss_fn = build(args)

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
