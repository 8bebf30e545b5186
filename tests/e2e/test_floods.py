"""A flood of each record kind at the markers' full rate, through a real sidecar: every
record the loop made is either received or dropped at the source and counted (the
summary's Records line), none lost on the way and none refused. Each kind sends a few
hundred thousand records; the sidecar aggregates all of them on arrays, so it keeps up,
and what a busy machine keeps it from taking is dropped where it is made, and said."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

import markers
import markers.gpu
from tests.e2e.test_gpu_path import CompletingBackend
from tests.support.helpers import Sidecar

RECORDS = 200_000  # per kind, about


def outside(run: Any, name: str = "forward") -> int:
    """Phases inside ``run.epoch()`` but outside any iteration: the epoch's begin and end
    and one record per phase."""
    count = RECORDS
    with run.epoch():
        for _ in range(count):
            with run.phase(name):
                pass
    return count + 2


def custom_outside(run: Any) -> int:
    return outside(run, "my own phase")


def custom_inside(run: Any) -> int:
    """A custom phase in every iteration: data loading, it, the loop record."""
    steps = RECORDS // 3
    for _ in run.train_batches(range(steps)):
        with run.phase("my own phase"):
            pass
    return 3 * steps


def cut_short(run: Any) -> int:
    """Iterations cut short (each begun while the last is open): a phase and the loop
    record flagged incomplete."""
    steps = RECORDS // 2
    for _ in range(steps):
        run.begin_iteration()
        with run.phase("forward"):
            pass
    run.leave_iteration()
    return 2 * steps


def validation_inside(run: Any) -> int:
    """A validation iteration inside every training one: training data loading, forward,
    validation data loading, evaluation, the validation loop, the training loop."""
    steps = RECORDS // 6
    for _ in run.train_batches(range(steps)):
        with run.phase("forward"):
            pass
        for _ in run.val_batches([0]):
            with run.phase("evaluation"):
                pass
    return 6 * steps


def gpu_timed(run: Any) -> int:
    """Forward timed on the (fake) GPU too: data loading, forward, the loop record."""
    steps = RECORDS // 3
    for _ in run.train_batches(range(steps)):
        with run.phase("forward"):
            pass
    return 3 * steps


FLOODS: dict[str, Callable[[Any], int]] = {
    "outside": outside,
    "custom_outside": custom_outside,
    "custom_inside": custom_inside,
    "cut_short": cut_short,
    "validation_inside": validation_inside,
    "gpu_timed": gpu_timed,
}
RECORDS_LINE = re.compile(
    r"^Records: received (\d+), dropped (\d+) \(not sent\), lost (\d+) "
    r"\(sent, never received\), rejected (\d+)$",
    re.M,
)


@pytest.mark.parametrize("kind", list(FLOODS))
def test_a_flood_of_each_kind_is_received_or_dropped_and_counted(
    kind: str, sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "gpu_timed":
        monkeypatch.setattr(
            markers.gpu,
            "open_gpu_timer",
            lambda **_: markers.gpu.GpuTimer(CompletingBackend(), 256),
        )
    with markers.start_run(
        out_dir="maps", warmup_iterations=0, train_batch_size=1, val_batch_size=1
    ) as run:
        sent = FLOODS[kind](run)
    summary = (sidecar.split_dir() / "summary.log").read_text()
    counts = RECORDS_LINE.search(summary)
    assert counts is not None, summary
    received, dropped, lost, rejected = map(int, counts.groups())
    assert (received + dropped, lost, rejected) == (sent, 0, 0), summary
    assert received > sent // 2  # the sidecar kept up with most of it
