"""markers.instrument(): a plain script, unchanged but for two lines, gets true, aligned
rows through module, autograd and optimizer hooks (docs/contract.md, Markers API and Semantics),
with a real sidecar."""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import re
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import markers
from tests.support.helpers import REPO, Sidecar, env, read_tsv
from tests.support.spin import (
    SpinNet,
    SpinSGD,
    Truth,
    assert_between,
    assert_close,
    one_thread,
    spin_loader,
)

SPINS = {
    "forward": 0.002,
    "backward": 0.002,
    "optimization": 0.001,
    "loading": 0.002,
    "val loading": 0.001,
}
TRAINING = [
    "Training loop (s)",
    "Training data loading (s)",
    "Forward (s)",
    "Backward (s)",
    "Optimization (s)",
]
VALIDATION = ["Validation loop (s)", "Validation data loading (s)", "Evaluation (s)"]
pytestmark = pytest.mark.usefixtures("one_thread")
__all__ = ["one_thread"]  # a fixture, used through pytestmark


def sums(values: list[float], group: int) -> list[float]:
    """Consecutive groups of ``group`` values summed (a short last group too)."""
    return [sum(values[i : i + group]) for i in range(0, len(values), group)]


def table(sidecar: Sidecar) -> pd.DataFrame:
    """The split's computational.tsv."""
    return read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")


def column(frame: pd.DataFrame, name: str) -> list[float]:
    """The stored values of one column."""
    return frame[name].dropna().tolist()


def plain_training(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    truth: Truth,
    epochs: int,
    batches: int,
    val_batches: int,
    accumulation: int = 1,
    run: markers.Run | None = None,
) -> None:
    """A plain PyTorch loop: accumulation, then a validation pass, per epoch. With
    ``run``, it also uses run.epoch()/validation()/train_batches()/val_batches()."""
    loss_fn = nn.MSELoss()
    for _ in range(epochs):
        epoch = run.epoch() if run else contextlib.nullcontext()
        with epoch:
            model.train()
            loader = spin_loader(truth, batches, SPINS["loading"])
            for i, (x, y) in enumerate(run.train_batches(loader) if run else loader):
                loss = loss_fn(model(x), y) / accumulation
                start = time.perf_counter()  # the whole call: what Backward holds
                loss.backward()
                truth.seconds["backward call"].append(time.perf_counter() - start)
                if (i + 1) % accumulation == 0 or i + 1 == batches:
                    optimizer.step()
                    optimizer.zero_grad()
            model.eval()
            with run.validation() if run else contextlib.nullcontext(), torch.no_grad():
                loader = spin_loader(truth, val_batches, SPINS["val loading"], part="val")
                for x, _y in run.val_batches(loader) if run else loader:
                    model(x)


def spin_parts(truth: Truth) -> tuple[SpinNet, SpinSGD]:
    """The model and optimizer with the known costs of SPINS."""
    model = SpinNet(truth, SPINS["forward"], SPINS["backward"])
    return model, SpinSGD(model.parameters(), truth, SPINS["optimization"])


@pytest.mark.parametrize("accumulation", [1, 3])
def test_plain_script_gets_true_aligned_rows(sidecar: Sidecar, accumulation: int) -> None:
    truth = Truth()
    model, optimizer = spin_parts(truth)
    with markers.start_run(out_dir="maps", warmup_iterations=1, accumulation_steps=accumulation):
        hooks = markers.instrument(model, optimizer)
        plain_training(
            model, optimizer, truth, epochs=2, batches=6, val_batches=3, accumulation=accumulation
        )
        hooks.remove()
    frame = table(sidecar)
    steps = 2 * (6 // accumulation)
    for name in TRAINING:  # the first step is warmup
        assert len(column(frame, name)) == steps - 1, name
    for name in VALIDATION:
        assert len(column(frame, name)) == 6, name
    assert frame["Epoch (s)"].isna().all()  # epochs need run.epoch()

    def true(part: str) -> list[float]:
        return sums(truth.seconds[part], accumulation)[1:]

    assert_close(column(frame, "Forward (s)"), true("forward"), "Forward")
    assert_between(
        column(frame, "Backward (s)"), true("backward"), true("backward call"), "Backward"
    )
    assert_close(
        column(frame, "Optimization (s)"), truth.seconds["optimization"][1:], "Optimization"
    )
    assert_close(column(frame, "Training data loading (s)"), true("loading"), "Data loading")
    assert_close(column(frame, "Evaluation (s)"), truth.seconds["evaluation"], "Evaluation")
    assert_close(
        column(frame, "Validation data loading (s)"),
        truth.seconds["val"],
        "Validation data loading",
    )
    loops = column(frame, "Training loop (s)")
    parts = [sum(v) for v in zip(*(column(frame, n) for n in TRAINING[1:]), strict=True)]
    assert all(loop >= part for loop, part in zip(loops, parts, strict=True))


def test_with_the_loop_helpers_nothing_is_counted_twice(sidecar: Sidecar) -> None:
    truth = Truth()
    model, optimizer = spin_parts(truth)
    with markers.start_run(out_dir="maps", warmup_iterations=0, accumulation_steps=2) as run:
        markers.instrument(model, optimizer)
        plain_training(
            model, optimizer, truth, epochs=2, batches=4, val_batches=2, accumulation=2, run=run
        )
    frame = table(sidecar)
    for name in TRAINING:
        assert len(column(frame, name)) == 4, name
    for name in VALIDATION:
        assert len(column(frame, name)) == 4, name
    assert len(column(frame, "Epoch (s)")) == 2
    assert len(column(frame, "Validation (s)")) == 2
    assert_close(column(frame, "Forward (s)"), sums(truth.seconds["forward"], 2), "Forward")
    assert_close(
        column(frame, "Training data loading (s)"),
        sums(truth.seconds["loading"], 2),
        "Data loading",
    )


def test_run_epoch_and_validation_bound_the_inferred_iterations(sidecar: Sidecar) -> None:
    # Without train_batches, the first data loading of an epoch starts at the epoch's
    # begin: code between epochs (here a 30 ms pause) is not taken for data loading.
    truth = Truth()
    model, optimizer = spin_parts(truth)
    loss_fn = nn.MSELoss()
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        markers.instrument(model, optimizer)
        for _ in range(2):
            Truth().spin("between epochs", 0.03)
            with run.epoch():
                model.train()
                for x, y in spin_loader(truth, 3, SPINS["loading"]):
                    loss_fn(model(x), y).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                model.eval()
                with run.validation():  # training mode, no no_grad: still evaluations
                    model.train()
                    for x, _y in spin_loader(truth, 2, SPINS["val loading"], part="val"):
                        model(x)
    frame = table(sidecar)
    assert_close(
        column(frame, "Training data loading (s)"), truth.seconds["loading"], "Data loading"
    )
    assert len(column(frame, "Evaluation (s)")) == 4
    assert len(column(frame, "Forward (s)")) == 6
    assert len(column(frame, "Validation (s)")) == 2


def test_gradscaler_step_is_optimization_and_a_skipped_step_ends_its_iteration(
    sidecar: Sidecar,
) -> None:
    # Optimization holds the whole scaler.step() (its unscale and inf check too), and a
    # step the scaler skips is an iteration like the others: rows stay aligned.
    truth = Truth()
    model, optimizer = spin_parts(truth)
    scaler = torch.amp.GradScaler("cpu")
    loss_fn = nn.MSELoss()
    skipped = 3
    stepped: list[float] = []  # the script's own clock around scaler.step()
    with markers.start_run(out_dir="maps", warmup_iterations=1) as run:
        markers.instrument(model, optimizer, run)
        for i, (x, y) in enumerate(spin_loader(truth, 8, SPINS["loading"])):
            loss = loss_fn(model(x), y)
            if i == skipped:  # inf gradients: GradScaler skips optimizer.step()
                loss = loss * float("inf")
            start = time.perf_counter()
            scaler.scale(loss).backward()
            truth.seconds["backward call"].append(time.perf_counter() - start)
            start = time.perf_counter()
            scaler.step(optimizer)
            stepped.append(time.perf_counter() - start)
            scaler.update()
            optimizer.zero_grad()
    assert len(truth.seconds["optimization"]) == 7  # the skipped step never ran
    frame = table(sidecar)
    for name in TRAINING:  # 8 batches: 1 warmup
        assert len(column(frame, name)) == 7, name

    def true(part: str) -> list[float]:
        return truth.seconds[part][1:]

    assert_close(column(frame, "Forward (s)"), true("forward"), "Forward")
    assert_between(
        column(frame, "Backward (s)"), true("backward"), true("backward call"), "Backward"
    )
    assert_close(column(frame, "Training data loading (s)"), true("loading"), "Data loading")
    spins = truth.seconds["optimization"]
    inner = [*spins[:skipped], 0.0, *spins[skipped:]]  # the skipped step: unscale, check
    measured = column(frame, "Optimization (s)")
    assert_between(measured, inner[1:], stepped[1:], "Optimization")


def test_two_optimizers_the_last_one_given_ends_the_iteration(sidecar: Sidecar) -> None:
    # A GAN: the discriminator steps, then the generator; the generator's fakes for the
    # discriminator step are made under no_grad in training mode.
    truth = Truth()
    generator = nn.Linear(8, 8)
    discriminator = SpinNet(truth, SPINS["forward"], SPINS["backward"])
    opt_g = SpinSGD(generator.parameters(), truth, 0.001)
    opt_d = SpinSGD(discriminator.parameters(), truth, 0.002)
    batches = 6
    with markers.start_run(out_dir="maps", warmup_iterations=2) as run:
        markers.instrument([generator, discriminator], [opt_d, opt_g], run)
        free = time.perf_counter()  # the script's clock: the previous step's end
        for x, _y in spin_loader(truth, batches, SPINS["loading"]):
            noise = torch.randn(4, 8)
            with torch.no_grad(), truth.around("forward"):
                # The script's clock up to the call that ends the data loading: a pause
                # while entering no_grad widens the row and its bound alike.
                truth.since("loading", free)
                fake = generator(noise)
            with truth.around("forward"):
                real_score = discriminator(x).mean()
            with truth.around("forward"):
                d_loss = real_score - discriminator(fake).mean()
            opt_d.zero_grad()
            d_loss.backward()
            with truth.around("optimization"):
                opt_d.step()
            with truth.around("forward"):
                g_loss = -discriminator(generator(noise)).mean()
            opt_g.zero_grad()
            g_loss.backward()
            with truth.around("optimization"):
                opt_g.step()
            free = truth.stepped_at  # before the hook that ends the iteration
    frame = table(sidecar)
    # The very first no_grad forward, before any training, is taken for an evaluation
    # (batch 0, warmup); every later one is part of its training iteration.
    for name in TRAINING:
        assert len(column(frame, name)) == batches - 1, name
    assert frame["Evaluation (s)"].isna().all()
    # Per iteration: three discriminator forwards (four calls timed by the script), two
    # backward passes, both steps.
    seconds = truth.seconds
    assert_between(
        column(frame, "Forward (s)"),
        sums(seconds["forward"], 3)[1:],
        sums(seconds["outer_forward"], 4)[1:],
        "Forward",
    )
    assert_between(
        column(frame, "Optimization (s)"),
        sums(seconds["optimization"], 2)[1:],
        sums(seconds["outer_optimization"], 2)[1:],
        "Optimization",
    )
    assert_between(
        column(frame, "Training data loading (s)"),
        seconds["loading"][1:],
        seconds["outer_loading"][1:],
        "Data loading",
    )


def test_a_step_bound_before_instrument_still_ends_each_iteration(sidecar: Sidecar) -> None:
    # ``step = optimizer.step`` taken before instrument() wrapped it: the optimizer's own
    # step hooks see the step, so every iteration ends at it, measured.
    truth = Truth()
    model, optimizer = spin_parts(truth)
    step = optimizer.step
    batches = 6
    with markers.start_run(out_dir="maps", warmup_iterations=1):
        markers.instrument(model, optimizer)
        for x, y in spin_loader(truth, batches, SPINS["loading"]):
            loss = nn.MSELoss()(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            step()
    frame = table(sidecar)
    for name in TRAINING:  # the first step is warmup
        assert len(column(frame, name)) == batches - 1, name
    assert_close(
        column(frame, "Optimization (s)"), truth.seconds["optimization"][1:], "Optimization"
    )
    assert_close(column(frame, "Forward (s)"), truth.seconds["forward"][1:], "Forward")


def test_a_compiled_model(sidecar: Sidecar) -> None:
    # torch.compile with its default backend (inductor builds C++ on this CPU box: ~30 s).
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    truth = Truth()
    with markers.start_run(out_dir="maps", warmup_iterations=2) as run:
        markers.instrument(compiled, optimizer, run)
        for x, y in spin_loader(truth, 6, SPINS["loading"]):
            nn.functional.mse_loss(compiled(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    frame = table(sidecar)
    for name in TRAINING:
        assert len(column(frame, name)) == 4, name
    assert_close(
        column(frame, "Training data loading (s)"), truth.seconds["loading"][2:], "Data loading"
    )


def test_remove_takes_every_hook_off(sidecar: Sidecar) -> None:
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        hooks = markers.instrument(model, optimizer, run)
        assert hooks.active
        hooks.remove()
        hooks.remove()
        assert not hooks.active
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert table(sidecar)["Forward (s)"].isna().all()


def test_a_deep_copy_of_an_instrumented_model_keeps_training_measured(sidecar: Sidecar) -> None:
    # An EMA model made with copy.deepcopy after instrument(): the copy takes the hooks
    # along, never the run behind them (a socket cannot be copied).
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        markers.instrument(model, optimizer, run)
        ema = copy.deepcopy(model)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert ema.weight is not model.weight
    assert len(column(table(sidecar), "Forward (s)")) == 3


def test_instrument_without_a_run_says_what_to_do() -> None:
    code = (
        "import torch, markers\n"
        "try:\n    markers.instrument(torch.nn.Linear(2, 2))\n"
        "except RuntimeError as exc:\n    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
        check=True,
    )
    assert "call markers.start_run() first" in result.stdout


def test_the_examples_differ_by_two_lines() -> None:
    plain = (REPO / "examples" / "train_plain.py").read_text()
    instrumented = (REPO / "examples" / "train_instrumented.py").read_text()

    def code(text: str) -> list[str]:  # without the module docstring
        return text.split('"""', 2)[2].splitlines()

    diff = [
        line for line in difflib.ndiff(code(plain), code(instrumented)) if line[:2] in ("+ ", "- ")
    ]
    assert [line for line in diff if line.startswith("- ")] == []
    added = [line[2:].strip() for line in diff]
    assert [line for line in added if line and line != "import markers"] == [
        "markers.start_run(out_dir=args.out_dir, warmup_iterations=10)",
        "markers.instrument(model, optimizer)",
    ]


def test_the_instrumented_example_writes_the_standard_columns(serve, short_tmp: Path) -> None:
    server = serve()
    subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_instrumented.py"),
            "--epochs",
            "2",
            "--train-samples",
            "1024",
        ],
        cwd=short_tmp,
        env=env(SIDECAR_ENDPOINT=server.endpoint),
        timeout=240,
        check=True,
        capture_output=True,
    )
    frame = read_tsv(server.split_dir() / "logs" / "computational.tsv")
    for name in (*TRAINING, *VALIDATION):
        assert frame[name].notna().sum() > 0, name


@pytest.mark.parametrize("broken", ["_forward", "_backward", "_optimization"])
def test_a_failing_hook_warns_once_and_training_goes_on(sidecar: Sidecar, broken: str) -> None:
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        hooks = markers.instrument(model, optimizer, run)
        # a bug inside the hooks: the forward, backward or step hooks raise
        setattr(hooks._hooks, broken, None)
        with pytest.warns(RuntimeWarning, match="a hook failed") as caught:
            for _ in range(3):
                model(torch.randn(2, 8)).sum().backward()
                optimizer.step()
        assert len([w for w in caught if "a hook failed" in str(w.message)]) == 1
        hooks.remove()
    assert table(sidecar)["Forward (s)"].isna().all()


def test_without_an_optimizer_the_models_own_steps_end_the_iterations(sidecar: Sidecar) -> None:
    truth = Truth()
    model, optimizer = spin_parts(truth)
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # not the model's
    with markers.start_run(out_dir="maps", warmup_iterations=1):
        markers.instrument(model)  # the global step hooks
        free = time.perf_counter()  # the script's clock: the previous step's end
        for x, y in spin_loader(truth, 6, SPINS["loading"]):
            out = model(x)
            # up to the forward's body, past the hook that ends the data loading (the
            # hooks between the loop's top and the body take longer in pure Python)
            truth.seconds["outer_loading"].append(truth.forward_began_at - free)
            nn.functional.mse_loss(out, y).backward()
            with truth.around("optimization"):
                optimizer.step()
            free = truth.stepped_at  # before the hook that ends the iteration
            optimizer.zero_grad()
            foreign.step()
    frame = table(sidecar)
    for name in TRAINING:
        assert len(column(frame, name)) == 5, name
    seconds = truth.seconds
    assert_between(
        column(frame, "Optimization (s)"),
        seconds["optimization"][1:],
        seconds["outer_optimization"][1:],
        "Optimization",
    )
    # zero_grad and the foreign step after the model's step are the next batch's data
    # loading: inside the script's clock from the step's end.
    assert_between(
        column(frame, "Training data loading (s)"),
        seconds["loading"][1:],
        seconds["outer_loading"][1:],
        "Data loading",
    )


def test_under_ddp_backward_holds_the_reducers_wait_for_the_all_reduce(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    # Two gloo ranks on CPU; rank 1 is slow, so rank 0's backward() waits in DDP's reducer
    # tail, a final callback the engine runs after any queued at the first backward node.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    job = REPO / "tests" / "support" / "jobs" / "ddp_job.py"
    truth_path = tmp_path / "truth.json"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(job), str(rank), port, str(truth_path)],
            cwd=tmp_path,
            env=env(SIDECAR_ENDPOINT=sidecar.endpoint),
            stdin=subprocess.DEVNULL,
        )
        for rank in (0, 1)
    ]
    assert [rank.wait(timeout=300) for rank in ranks] == [0, 0]
    backward_s = json.loads(truth_path.read_text())["backward"]
    assert min(backward_s[1:]) > 0.03  # the wait for the slow rank is inside backward()
    assert_close(column(table(sidecar), "Backward (s)"), backward_s[1:], "Backward")


def test_trailing_micro_batches_that_never_step_are_cut_short_and_counted(sidecar: Sidecar) -> None:
    # Accumulation written the usual way: 10 batches an epoch, a step every 4th, so the
    # last 2 of each epoch never step. They are no whole iteration: no row without its
    # Optimization, and phases.tsv keeps them flagged with the 2 batches that went through.
    truth = Truth()
    model, optimizer = spin_parts(truth)
    loss_fn = nn.MSELoss()
    with markers.start_run(out_dir="maps", warmup_iterations=1) as run:
        markers.instrument(model, optimizer, run)
        for _ in range(2):
            with run.epoch():
                for i, (x, y) in enumerate(spin_loader(truth, 10, SPINS["loading"])):
                    loss_fn(model(x), y).backward()
                    if (i + 1) % 4 == 0:
                        with truth.around("optimization"):
                            optimizer.step()
                        optimizer.zero_grad()
            optimizer.zero_grad()
    frame = table(sidecar)
    for name in TRAINING:  # 4 steps, the first is warmup
        assert len(column(frame, name)) == 3, name
    assert_between(
        column(frame, "Optimization (s)"),
        truth.seconds["optimization"][1:],
        truth.seconds["outer_optimization"][1:],
        "Optimization",
    )
    phases = read_tsv(sidecar.split_dir() / "logs" / "phases.tsv")
    loops = phases[phases["phase"] == "Training loop"]
    cut = loops[loops["flag"] == "incomplete"]
    assert sorted(cut["epoch"]) == [0, 1] and set(cut["batches"]) == {2}
    assert loops["batches"].sum() == 16  # 20, less the warmup iteration's 4 (not stored)


def test_phases_without_a_loop_driver_warn_once_naming_the_two_ways(sidecar: Sidecar) -> None:
    # The natural first try: run.phase inside run.epoch(), no train_batches, no hooks.
    expected = r"run\.train_batches.*markers\.instrument"
    with (
        pytest.warns(RuntimeWarning, match=expected) as seen,
        markers.start_run(out_dir="maps") as run,
    ):
        for _ in range(2):
            with run.epoch():
                for _ in range(3):
                    with run.phase("forward"):
                        pass
    assert len([w for w in seen if "no iteration" in str(w.message)]) == 1
    with warnings.catch_warnings():  # with the driver: no such warning
        warnings.filterwarnings("error", message=".*no iteration was measured")
        with markers.start_run(out_dir="driven") as run, run.epoch():
            for _ in run.train_batches(range(3)):
                with run.phase("forward"):
                    pass


def test_a_short_batch_inside_a_step_counts_the_samples_it_holds(sidecar: Sidecar) -> None:
    # Sizes read from the batches, a step every 4 batches: the loader's last batch (10 of
    # 64) is the second of the last step, which held 74 samples, not 2 x 64.
    model, loss_fn = nn.Linear(3, 1), nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = [64] * 9 + [10]
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        markers.instrument(model, optimizer, run)
        with run.epoch():
            for i, n in enumerate(sizes):
                loss_fn(model(torch.zeros(n, 3)), torch.zeros(n, 1)).backward()
                if i % 4 == 3 or i == len(sizes) - 1:
                    optimizer.step()
                    optimizer.zero_grad()
    loops = column(table(sidecar), "Training loop (s)")
    assert len(loops) == 3
    summary = (sidecar.split_dir() / "summary.log").read_text()
    throughput = re.search(r"^Throughput: (\S+) images/s", summary, re.M)
    assert throughput is not None, summary
    assert float(throughput[1]) == pytest.approx(sum(sizes) / sum(loops), rel=1e-3)
