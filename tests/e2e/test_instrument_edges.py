"""markers.instrument() where a script leaves the plain path: a forward that raises and
is retried, a test pass under no_grad in training mode, compiled models, DataParallel.
Each against the script's own clock (``tests.support.spin``), with a real sidecar."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import markers
from tests.support.helpers import Sidecar, read_tsv
from tests.support.spin import SpinNet, SpinSGD, Truth, assert_close, one_thread, spin_loader

pytestmark = pytest.mark.usefixtures("one_thread")
__all__ = ["one_thread"]  # a fixture, used through pytestmark

FORWARD_S = 0.002


def column(sidecar: Sidecar, name: str) -> list[float]:
    """The stored values of one column of the split's computational.tsv."""
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    return frame[name].dropna().tolist() if name in frame else []


class OutOfMemory(RuntimeError):
    """What a CUDA allocator raises for a batch too large (a RuntimeError subclass)."""


class LimitedNet(SpinNet):
    """A SpinNet that 'runs out of memory' for a batch over ``limit`` samples."""

    limit = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise OutOfMemory("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


def test_a_forward_that_raises_once_does_not_stop_the_forward_stamps(sidecar: Sidecar) -> None:
    # The "catch the OOM, halve the batch" pattern: step 3's batch is too large once.
    truth = Truth()
    model = LimitedNet(truth, FORWARD_S)
    optimizer = SpinSGD(model.parameters(), truth)
    steps = 12
    with markers.start_run(out_dir="maps", warmup_iterations=1) as run:
        markers.instrument(model, optimizer, run)
        for i, (x, y) in enumerate(spin_loader(truth, steps, size=4)):
            if i == 3:
                x, y = torch.cat([x, x]), torch.cat([y, y])
            while True:
                try:
                    out = model(x)
                    break
                except OutOfMemory:
                    x, y = x[: len(x) // 2], y[: len(y) // 2]
            nn.functional.mse_loss(out, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    # Every step after the warmup one is measured, the retried one too: the failed
    # attempt's iteration is left, and the retry starts one of its own.
    assert len(truth.seconds["forward"]) == steps
    assert_close(column(sidecar, "Forward (s)"), truth.seconds["forward"][1:], "Forward")
    assert len(column(sidecar, "Optimization (s)")) == steps - 1


def test_a_no_grad_pass_in_training_mode_after_training_is_evaluation(sidecar: Sidecar) -> None:
    truth = Truth()
    model = SpinNet(truth, FORWARD_S)
    optimizer = SpinSGD(model.parameters(), truth)
    with markers.start_run(out_dir="maps", warmup_iterations=1) as run:
        markers.instrument(model, optimizer, run)
        for x, y in spin_loader(truth, 5):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():  # a test pass, the model still in training mode
            for x, _y in spin_loader(truth, 4, part="test loading"):
                model(x)
    assert model.training and len(truth.seconds["evaluation"]) == 4
    assert_close(column(sidecar, "Evaluation (s)"), truth.seconds["evaluation"], "Evaluation")
    assert len(column(sidecar, "Validation loop (s)")) == 4
    assert_close(column(sidecar, "Forward (s)"), truth.seconds["forward"][1:], "Forward")


def test_hooks_shared_across_threads_say_so_and_the_wrapper_is_measured(
    sidecar: Sidecar,
) -> None:
    # nn.DataParallel's replicas copy their module's hooks and run in worker threads (it
    # takes two GPUs to see); the same happens when a thread calls the module.
    truth = Truth()
    model = SpinNet(truth, FORWARD_S)
    optimizer = SpinSGD(model.parameters(), truth)
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        hooks = markers.instrument(model, optimizer, run)
        x = torch.zeros(4, 8)
        model(x)
        worker = threading.Thread(target=model, args=(x,))
        with pytest.warns(
            RuntimeWarning, match=r"nn\.DataParallel.*Instrument the DataParallel wrapper"
        ):
            worker.start()
            worker.join()
        hooks.remove()
        # The wrapper instrumented: its whole call is one Forward (here, without GPUs,
        # it calls the module itself).
        truth.seconds.clear()
        wrapper = nn.DataParallel(model)
        markers.instrument(wrapper, optimizer, run)
        for x, y in spin_loader(truth, 4):
            nn.functional.mse_loss(wrapper(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_close(column(sidecar, "Forward (s)"), truth.seconds["forward"], "Forward")


@pytest.mark.parametrize("order", ["compile, instrument", "instrument, compile", "torch.compile"])
def test_a_model_compiled_after_or_before_instrument_is_measured(
    sidecar: Sidecar, order: str
) -> None:
    # Dynamo's eager backend: what matters is that Dynamo traces the module's call, hooks
    # included (the default backend builds C++ and takes half a minute more).
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    truth = Truth()
    steps, warmup = 10, 3
    with markers.start_run(out_dir="maps", warmup_iterations=warmup) as run:
        if order == "compile, instrument":
            model.compile(backend="eager")
        markers.instrument(model, optimizer, run)
        if order == "instrument, compile":
            model.compile(backend="eager")
        call = torch.compile(model, backend="eager") if order == "torch.compile" else model
        for x, y in spin_loader(truth, steps, 0.002):
            with truth.around("step"):
                nn.functional.mse_loss(call(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    # Compiled after instrument(), the first step's hooks are traced (no stamps): the
    # hooks move out of the graph at its backward, and warmup counts from the next step.
    measured = steps - warmup - (order != "compile, instrument")
    for name in ("Forward (s)", "Backward (s)", "Optimization (s)", "Training loop (s)"):
        assert len(column(sidecar, name)) == measured, name
    # Each Forward within its step as the script timed it; data loading as the loader spun.
    outer = truth.seconds["outer_step"][-measured:]
    for forward, step in zip(column(sidecar, "Forward (s)"), outer, strict=True):
        assert 0 < forward < step
    assert_close(
        column(sidecar, "Training data loading (s)"),
        truth.seconds["loading"][-measured:],
        "Loading",
    )
