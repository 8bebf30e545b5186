"""W&B history rows (sidecar.exports.wandb): W&B keeps one value per name and step and
drops a point below its current step, so several points of one name at one optimizer
step take rows of their own, and a late point takes the next free row, never a lower one."""

from __future__ import annotations

import pytest

pytest.importorskip("wandb")  # the extra trainmon[wandb]

from sidecar.exports.wandb import STEP_KEY, STEP_SLOTS, history_rows, run_id


def test_points_of_one_name_at_one_step_get_rows_of_their_own() -> None:
    evaluation = "phases/evaluation_wall_s"
    points = [
        ((evaluation, 0.1, 5, 0.0), 5),
        ((evaluation, 0.2, 5, 0.0), 5),
        (("system/cpu", 40.0, 5, 0.0), 5),
        (("phases/forward_wall_s", 0.3, 4, 0.0), 4),
    ]
    rows, last = history_rows(points, -1)
    assert rows == [
        {"_step": 4 * STEP_SLOTS, STEP_KEY: 4, "phases/forward_wall_s": 0.3},
        {"_step": 5 * STEP_SLOTS, STEP_KEY: 5, evaluation: 0.1, "system/cpu": 40.0},
        {"_step": 5 * STEP_SLOTS + 1, STEP_KEY: 5, evaluation: 0.2},
    ]
    assert last == 5 * STEP_SLOTS + 1


def test_a_late_point_takes_the_next_free_row_at_its_own_step() -> None:
    # an epoch's row is at the step it began, and is stored when the epoch ends
    rows, last = history_rows([(("phases/epoch_wall_s", 2.0, 0, 0.0), 0)], 11 * STEP_SLOTS)
    assert rows == [{"_step": 11 * STEP_SLOTS + 1, STEP_KEY: 0, "phases/epoch_wall_s": 2.0}]
    assert last == 11 * STEP_SLOTS + 1
    # goodput at the step reached (12) takes the slots of the step done (11)
    rows, _ = history_rows([(("goodput/wall_s", 9.0, 12, 0.0), 11)], -1)
    assert rows == [{"_step": 11 * STEP_SLOTS, STEP_KEY: 12, "goodput/wall_s": 9.0}]


def test_the_run_id_is_the_same_for_every_session_of_a_split() -> None:
    assert run_id("abc", 0) == run_id("abc", 0)
    assert run_id("abc", 0) != run_id("abc", 1) != run_id("abd", 0)
