"""A Hugging Face Trainer run monitored by MonitorCallback, offline: a tiny BERT built
from a config, or a model with known costs (tests/support/spin.py). Writes what each
part really took to ``--truth``.

    python tests/support/jobs/transformers_job.py --truth t.json --out OUT
        [--model spin|bert] [--accumulation N] [--max-steps S] [--eval-steps E]
        [--eval-epochs] [--save-steps S] [--resume] [--kill-at-step N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # after the offline switch
from torch import nn
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from markers.integrations.transformers import MonitorCallback
from tests.support.spin import FEATURES, SpinNet, SpinSGD, Truth

COSTS = {
    "forward": 0.008,
    "backward": 0.006,
    "optimization": 0.004,
    "loading": 0.004,
    "evaluation": 0.003,
}
SEQUENCE = 16


class SpinSamples(Dataset):
    """Samples for the spin model; each takes ``seconds`` (1-3 x in turn) to load."""

    def __init__(self, truth: Truth, size: int, seconds: float, part: str) -> None:
        self.truth, self.size, self.seconds, self.part = truth, size, seconds, part

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.truth.spin(self.part, self.truth.cost(self.part, self.seconds))
        generator = torch.Generator().manual_seed(index)
        return {
            "x": torch.randn(FEATURES, generator=generator),
            "labels": torch.randn(1, generator=generator),
        }


class TokenSamples(Dataset):
    """Random token sequences with binary labels, for the tiny BERT."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(size)
        self.ids = torch.randint(1, 128, (size, SEQUENCE), generator=generator)
        self.labels = torch.randint(0, 2, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[index],
            "attention_mask": torch.ones(SEQUENCE, dtype=torch.long),
            "labels": self.labels[index],
        }


class SpinRegressor(nn.Module):
    """SpinNet with the Trainer's interface: returns the loss when given labels."""

    def __init__(self, truth: Truth) -> None:
        super().__init__()
        self.net = SpinNet(truth, COSTS["forward"], COSTS["backward"])

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class TimedCallback(MonitorCallback):
    """MonitorCallback whose ``on_train_begin`` is timed (it is inside ``train()``)."""

    begin_s = 0.0

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_begin(*args, **kwargs)
        self.begin_s = time.perf_counter() - start


class KillAtStep(TrainerCallback):
    """SIGKILLs the process when a step begins at ``step`` steps (after the save of the
    step before)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--truth", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=("spin", "bert"), default="spin")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--eval-steps", type=int, default=0)
    parser.add_argument("--eval-epochs", action="store_true", help="evaluate at epoch ends")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at-step", type=int)
    args = parser.parse_args()

    torch.set_num_threads(1)
    truth = Truth()
    optimizers: tuple[torch.optim.Optimizer | None, None] = (None, None)
    if args.model == "spin":
        model: nn.Module = SpinRegressor(truth)
        train = SpinSamples(truth, args.samples, COSTS["loading"], "loading")
        evaluation = SpinSamples(truth, 8, COSTS["loading"], "val")
        optimizers = (SpinSGD(model.parameters(), truth, COSTS["optimization"]), None)
    else:
        model = BertForSequenceClassification(
            BertConfig(
                vocab_size=128,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=SEQUENCE,
            )
        )
        train, evaluation = TokenSamples(args.samples), TokenSamples(8)
    training_args = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.accumulation,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        eval_strategy="epoch" if args.eval_epochs else "steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    callback = TimedCallback(warmup_iterations=1)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        optimizers=optimizers,
        callbacks=[callback, *([KillAtStep(args.kill_at_step)] if args.kill_at_step else [])],
    )
    output = trainer.train(resume_from_checkpoint=True if args.resume else None)
    with open(args.truth, "w") as handle:
        json.dump(
            {
                **truth.seconds,
                "on_train_begin": callback.begin_s,
                "train_runtime": output.metrics["train_runtime"],
            },
            handle,
        )


if __name__ == "__main__":
    main()
