"""A training job per loop shape (docs/iteration-model.md), for the loop-shape tests.

    python shapes_job.py SHAPE TRUTH.json [--resume]

Durations are injected with sleeps of tens of milliseconds, and the job keeps its own
``perf_counter`` clock around everything it does: for each phase the time just inside the
marker (``inner``) and just outside it (``outer``); for each iteration the window from the
end of the previous one (or the loop's start) to the end of its body. A stored row must lie
between what the loop saw inside and outside the marker. The clock goes to TRUTH.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import markers
from markers.buffer import FLUSH_AGE_NS

MS = 0.001
perf_counter = time.perf_counter


class Clock:
    """What the loop itself measured, by label, in order."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.truth: dict[str, list[dict[str, float]]] = {}
        self.last_end: dict[str, float] = {}  # per loop label: its previous body's end

    def add(self, label: str, **values: float) -> None:
        self.truth.setdefault(label, []).append(values)

    def phase(self, name: str, label: str, seconds: float) -> None:
        """``with run.phase(name)`` around a sleep of ``seconds``; recorded under ``label``."""
        outer = perf_counter()
        with self.run.phase(name):
            inner = perf_counter()
            time.sleep(seconds)
            inner = perf_counter() - inner
        self.add(label, inner=inner, outer=perf_counter() - outer)

    def loader(
        self,
        batches: int,
        seconds: float,
        label: str = "Training data loading",
        inside: str | None = None,
    ) -> Iterator[list[int]]:
        """A loader whose batches take ``seconds`` to arrive; with ``inside``, that phase is
        timed within the loader (it belongs to the batch it loads). ``inner``: the sleep;
        ``outer`` is set by ``arrived``."""
        for _ in range(batches):
            start = perf_counter()
            if inside:
                self.phase(inside, inside, seconds)
            else:
                time.sleep(seconds)
            self.add(label, inner=perf_counter() - start)
            yield [0, 0, 0, 0]

    def arrived(self, loop: str = "Training loop") -> None:
        """First thing in a body: the fetch of its batch lay between the previous body's end
        (or the loop's start) and now."""
        label = "Validation data loading" if loop == "Validation loop" else "Training data loading"
        self.truth[label][-1]["outer"] = perf_counter() - self.last_end[loop]

    def start_loop(self, label: str = "Training loop") -> None:
        self.last_end[label] = perf_counter()

    def end_body(self, label: str = "Training loop", **extra: float) -> None:
        """The body of one iteration ended: its window since the previous one's end."""
        now = perf_counter()
        self.add(label, outer=now - self.last_end[label], **extra)
        self.last_end[label] = now

    def step(self, durations: tuple[float, float, float]) -> None:
        for name, label, seconds in zip(
            ("forward", "backward", "optimization"),
            ("Forward", "Backward", "Optimization"),
            durations,
            strict=True,
        ):
            self.phase(name, label, seconds)


@contextmanager
def window(clock: Clock, label: str) -> Iterator[None]:
    """Time a span (epoch, validation) inside and outside ``run.epoch()``-like markers."""
    outer = perf_counter()
    yield
    clock.add(label, outer=perf_counter() - outer)


def plain(run: Any, clock: Clock) -> None:
    with run.epoch():
        clock.start_loop()
        for _ in run.train_batches(clock.loader(3, 10 * MS)):
            clock.arrived()
            clock.step((20 * MS, 15 * MS, 5 * MS))
            clock.end_body()


def break_out(run: Any, clock: Clock) -> None:
    # Epoch 0 leaves after the body of its 3rd iteration (max-steps style); epoch 1 after
    # fetching its 3rd batch, before using it; epoch 2 runs whole. Each epoch has its own
    # durations, so anything moved into the next iteration shows.
    for epoch, (leave_after, used) in enumerate(((3, True), (2, False), (None, True))):
        with run.epoch():
            clock.start_loop()
            for i, _ in enumerate(run.train_batches(clock.loader(4, (5 + 5 * epoch) * MS))):
                clock.arrived()
                if i == leave_after and not used:
                    clock.add("left", outer=perf_counter() - clock.last_end["Training loop"])
                    break
                clock.step(((10 + 10 * epoch) * MS, (20 + 5 * epoch) * MS, 5 * MS))
                clock.end_body()
                if leave_after is not None and i + 1 == leave_after and used:
                    break


def validation_inside(run: Any, clock: Clock) -> None:
    with run.epoch():
        clock.start_loop()
        for i, _ in enumerate(run.train_batches(clock.loader(4, 5 * MS))):
            clock.arrived()
            clock.phase("forward", "Forward", 20 * MS)
            clock.phase("backward", "Backward", 15 * MS)
            away = 0.0
            if i % 2:  # validation every 2nd step, between backward and optimization
                outer = perf_counter()
                with run.validation():
                    inner = perf_counter()
                    clock.start_loop("Validation loop")
                    for _ in run.val_batches(clock.loader(2, 5 * MS, "Validation data loading")):
                        clock.arrived("Validation loop")
                        clock.phase("evaluation", "Evaluation", 10 * MS)
                        clock.end_body("Validation loop")
                    inner = perf_counter() - inner
                clock.add("Validation", inner=inner, outer=perf_counter() - outer)
                away = inner
            clock.phase("optimization", "Optimization", 5 * MS)
            clock.end_body(away=away)


def names(run: Any, clock: Clock) -> None:
    with run.epoch():
        clock.start_loop()
        for _ in run.train_batches(clock.loader(3, 5 * MS)):
            clock.step((10 * MS, 10 * MS, 5 * MS))
            for name in ("Forward", "training LOOP", "EPOCH", "Forward GPU"):
                with run.phase(name):  # refused: measures nothing, warns once per name
                    time.sleep(3 * MS)
            clock.phase("my\tphase\nname", "my phase name", 4 * MS)
            clock.end_body()


def resume(run: Any, clock: Clock, second: bool) -> None:
    # The first process names "a" then "b"; the resumed one "b" then "a", with other
    # durations: each column must hold its own name's measurements.
    order = (("b", 25 * MS), ("a", 15 * MS)) if second else (("a", 10 * MS), ("b", 20 * MS))
    with run.epoch():
        clock.start_loop()
        for _ in run.train_batches(clock.loader(3, 5 * MS)):
            clock.phase("forward", "Forward", 5 * MS)
            for name, seconds in order:
                clock.phase(name, name, seconds)
            clock.end_body()
    run.checkpoint()


def loader_phases(run: Any, clock: Clock) -> None:
    import torch.utils.data

    class Dataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> list[int]:
            clock.phase("decode", "decode", 8 * MS)
            return [index]

    with run.epoch():
        clock.start_loop()  # a generator timing a phase per batch
        for _ in run.train_batches(clock.loader(3, 6 * MS, inside="augment")):
            clock.phase("forward", "Forward", 10 * MS)
            clock.end_body()
    with run.epoch():
        clock.start_loop()  # Dataset.__getitem__ in this process (num_workers=0)
        loader = torch.utils.data.DataLoader(Dataset(), batch_size=2, num_workers=0)
        for _ in run.train_batches(loader):
            clock.phase("forward", "Forward", 10 * MS)
            clock.end_body()
    with run.epoch():  # in worker processes: counted, not measured
        loader = torch.utils.data.DataLoader(
            Dataset(), batch_size=1, num_workers=2, multiprocessing_context="fork"
        )
        for _ in run.train_batches(loader):
            with run.phase("forward"):
                time.sleep(2 * MS)


def nested(run: Any, clock: Clock) -> None:
    @run.phase("forward")
    def helper() -> None:
        time.sleep(10 * MS)

    with run.epoch():
        clock.start_loop()
        for _ in run.train_batches(clock.loader(3, 5 * MS)):
            outer = perf_counter()
            with run.phase("forward"):
                inner = perf_counter()
                time.sleep(10 * MS)
                helper()  # the same phase inside itself: one measurement, the outer
                inner = perf_counter() - inner
            clock.add("Forward", inner=inner, outer=perf_counter() - outer)
            clock.phase("backward", "Backward", 10 * MS)
            clock.end_body()


def probe(run: Any, clock: Clock) -> None:
    with run.epoch():
        clock.start_loop()
        for _ in run.train_batches(clock.loader(3, 5 * MS)):
            clock.step((10 * MS, 10 * MS, 5 * MS))
            clock.end_body()
        clock.phase("forward", "probe", 30 * MS)  # after the loop: outside any iteration


def cut(run: Any, clock: Clock, how: str) -> None:
    for epoch in range(2):
        outer = perf_counter()
        with run.epoch():
            clock.start_loop()
            for i, _ in enumerate(run.train_batches(clock.loader(3, 5 * MS))):
                clock.phase("forward", "Forward", 20 * MS)
                if epoch == 1 and i == 1:
                    save(clock)
                    if how == "exception":
                        raise RuntimeError("loss is NaN")
                    if how == "sigint":
                        os.kill(os.getpid(), signal.SIGINT)
                        time.sleep(1)  # KeyboardInterrupt arrives here
                    time.sleep(FLUSH_AGE_NS / 1e9 + 0.05)  # past the flush age, so that
                    with run.phase("backward"):  # this phase's end flushes what is buffered
                        pass
                    time.sleep(0.2)  # and ZeroMQ's I/O thread has sent it before the kill
                    os.kill(os.getpid(), signal.SIGKILL)
                clock.phase("backward", "Backward", 10 * MS)
                clock.end_body()
        clock.add("Epoch", outer=perf_counter() - outer)


def accumulation(run: Any, clock: Clock) -> None:
    with run.epoch():
        clock.start_loop()
        for i, _ in enumerate(run.train_batches(clock.loader(7, 5 * MS))):
            clock.arrived()
            clock.phase("forward", "Forward", 10 * MS)
            clock.phase("backward", "Backward", 5 * MS)
            if i % 3 == 2 or i == 6:  # steps of 3, 3 and the last 1
                clock.phase("optimization", "Optimization", 5 * MS)
                clock.end_body()


def short_batch(run: Any, clock: Clock) -> None:
    """Batch sizes read from the batches (none given), 4 batches a step: the loader's last
    batch (10 samples, the others 64) falls inside the last step, beside a full one. The
    samples the loop got are counted here."""
    import torch

    sizes = [64] * 9 + [10]
    loader = ((torch.zeros(n, 3), torch.zeros(n)) for n in sizes)
    with run.epoch():
        clock.start_loop()
        for i, (inputs, _) in enumerate(run.train_batches(loader)):
            clock.add("samples", count=len(inputs))
            clock.phase("forward", "Forward", 2 * MS)
            if i % 4 == 3 or i == len(sizes) - 1:
                clock.end_body()


SHAPES = {
    "plain": (plain, {}),
    "break": (break_out, {}),
    "validation": (validation_inside, {}),
    "names": (names, {}),
    "loader": (loader_phases, {}),
    "nested": (nested, {}),
    "probe": (probe, {}),
    "accumulation": (accumulation, {"accumulation_steps": 3}),
    "short_batch": (short_batch, {"accumulation_steps": 4, "train_batch_size": None}),
    # The same batches with their usual size given: the readable size still wins.
    "short_given": (short_batch, {"accumulation_steps": 4, "train_batch_size": 64}),
}
TRUTH = ""


def save(clock: Clock) -> None:
    """Write the loop's clock to the truth file."""
    with open(TRUTH, "w") as handle:
        json.dump(clock.truth, handle)


def main() -> None:
    global TRUTH
    parser = argparse.ArgumentParser()
    parser.add_argument("shape")
    parser.add_argument("truth")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    TRUTH = args.truth
    settings: dict[str, Any] = {
        "accumulation_steps": 1,
        "train_batch_size": 4,
        "val_batch_size": 4,
    }
    if args.shape in SHAPES:
        settings.update(SHAPES[args.shape][1])
    run = markers.start_run(
        out_dir="maps", warmup_iterations=0, num_measurements=1000, resume=args.resume, **settings
    )
    clock = Clock(run)
    with run:
        if args.shape in SHAPES:
            SHAPES[args.shape][0](run, clock)
        elif args.shape == "resume":
            resume(run, clock, args.resume)
        else:
            cut(run, clock, args.shape)
    save(clock)


if __name__ == "__main__":
    main()
