"""The iteration model's once-a-step verbs in C (markers/_iteration.c: ``end_whole``,
``begin_training``, ``batch_done``, what instrument()'s hooks call) write exactly the
records the Python verbs (``markers.iteration.PURE_VERBS``: the ``Iterations`` methods)
write: their own common case, and each case they leave to Python (an iteration still
open, suspended or left, a context that is not the current one, the count of a GPU
check), with flushes in between. One scripted sequence with given times runs on a real
Run, a real socket standing in for the sidecar, once per set of verbs; the records read
back must be the same, and some are spelled out (the same wrong answer twice would not
pass)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from markers import iteration, wire
from markers.iteration import Verbs
from tests.unit.test_driver_speedups import sent, wired_run

COMPILED = iteration.accelerated_verbs()
VERBS = [iteration.PURE_VERBS, COMPILED]
TRAIN, VAL = wire.LOOP_ID[False], wire.LOOP_ID[True]
LOADING = wire.TRAINING_DATA_LOADING


def play(tmp_path: Path, verbs: Verbs | None, name: str) -> tuple[list[dict[str, Any]], int]:
    """The script through ``verbs``: the records sent, and how often the GPU check ran."""
    if verbs is None:
        pytest.skip("markers._speedups is not built here")
    end_whole, begin_training, batch_done = verbs
    run, sender, router = wired_run(tmp_path, name, 1)
    model, buffer = run._iter, run._buffer
    checks = []
    model._check_gpu = lambda: checks.append(model.counts[False])
    try:
        buffer.flush_at = 10 * wire.SLOT_WIDTH  # flushes inside the script, C and Python
        end_whole(model, 5)  # nothing open: nothing happens
        begin_training(model, 10, 20)
        batch_done(model)
        batch_done(model)
        end_whole(model, 30)
        # A validation iteration inside a training one: it suspends it; its end is C's
        # (the open one, its context current); the training one left suspended is cut
        # when the next begins (Python's case).
        begin_training(model, 40, 45)
        model.begin_iteration(True, 50)
        batch_done(model)
        end_whole(model, 60)
        begin_training(model, 70, 75)
        batch_done(model)
        end_whole(model, 80)
        # A loop left: the next begin settles it (Python's case).
        begin_training(model, 90, 95)
        batch_done(model)
        model.defer_left_loop(100)
        begin_training(model, 110, 115)
        batch_done(model)
        # An iteration whose context is no longer the current one: Python's end.
        model.set_outside()
        end_whole(model, 120)
        # Still open when the next begins: cut by Python.
        begin_training(model, 130, 135)
        begin_training(model, 140, 145)
        # Long enough for the GPU check (every GPU_CHECK_EVERY training iterations).
        for i in range(iteration.GPU_CHECK_EVERY + 5):
            at = 200 + 10 * i
            if i:
                begin_training(model, at, at + 3)
            batch_done(model)
            end_whole(model, at + 8)
        records = sent(run, router)
    finally:
        sender.close()
        router.close(linger=0)
    return records, len(checks)


@pytest.mark.skipif(COMPILED is None, reason="markers._speedups is not built here")
def test_compiled_and_python_verbs_write_the_same_records(tmp_path: Path) -> None:
    pure, pure_checks = play(tmp_path, iteration.PURE_VERBS, "pure")
    compiled, compiled_checks = play(tmp_path, COMPILED, "compiled")
    assert compiled == pure
    assert compiled_checks == pure_checks == 1


@pytest.mark.parametrize("verbs", VERBS, ids=["python", "compiled"])
def test_the_verbs_write_the_loops_spelled_out(tmp_path: Path, verbs: Verbs | None) -> None:
    records, checks = play(tmp_path, verbs, "spelled")
    assert checks == 1
    loops = [
        (r["phase"], r["batches"], r["start_ns"], r["end_ns"], r["flags"])
        for r in records
        if r.get("phase") in (TRAIN, VAL)
    ]
    cut = wire.FLAG_IN_ITERATION | wire.FLAG_INCOMPLETE
    whole = wire.FLAG_IN_ITERATION
    assert loops[:6] == [
        (TRAIN, 2, 10, 30, whole),
        (VAL, 1, 50, 60, whole | wire.FLAG_VALIDATION),
        (TRAIN, 0, 40, 50, cut),  # cut at 70, its 20 ns suspended taken off its end
        (TRAIN, 1, 70, 80, whole),
        (TRAIN, 1, 90, 100, whole),  # the loop left at 100, settled whole
        (TRAIN, 1, 110, 120, whole),
    ]
    # 130's held no batch but its data loading: cut; 140's holds the first batch below.
    assert loops[6:8] == [(TRAIN, 0, 130, 140, cut), (TRAIN, 1, 140, 208, whole)]
    assert len(loops) == 7 + iteration.GPU_CHECK_EVERY + 5
    loading = [(r["start_ns"], r["end_ns"]) for r in records if r.get("phase") == LOADING]
    assert loading[:3] == [(10, 20), (40, 45), (70, 75)]
    assert len(loading) == 7 + iteration.GPU_CHECK_EVERY + 4


def test_the_verbs_selected_follow_the_switch() -> None:
    pure = iteration.os.environ.get(iteration.PURE_PYTHON_ENV, "") not in ("", "0")
    assert iteration.ACCELERATED is (not pure and COMPILED is not None)
