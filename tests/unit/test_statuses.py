"""The two status orders and the record counts of a split, each defined once in
``sidecar.model.split``: a split's status is the worst ending of its ranks (any ending
beats "running"), a run's (run.json's top level) the worst of its splits, where a split
still running keeps the run from being completed."""

from __future__ import annotations

import json
from pathlib import Path

from sidecar.model.aggregator import Settings
from sidecar.model.derived import derive
from sidecar.model.split import Split
from sidecar.sinks import run_file


def _split(folder: Path, index: int) -> Split:
    return Split(folder, index, Settings(), {"start_unix": 100.0})


def _run_json(split: Split, existing: str) -> str:
    return run_file.run_json(split, derive(split), split.record_counts(), existing)


def test_a_split_takes_the_worst_ending_of_its_ranks(tmp_path: Path) -> None:
    split = _split(tmp_path, 0)
    split.set_status("completed", None)  # the first rank to end replaces "running"
    assert split.status == "completed"
    split.set_status("incomplete", "rank 1 killed")
    split.set_status("completed", None)  # a later good ending does not hide it
    assert (split.status, split.cause) == ("incomplete", "rank 1 killed")
    split.set_status("failed", "boom")
    assert split.status == "failed"


def test_a_run_is_running_while_one_of_its_splits_runs(tmp_path: Path) -> None:
    done, going = _split(tmp_path, 0), _split(tmp_path, 1)
    done.set_status("completed", None)
    text = _run_json(going, _run_json(done, ""))
    assert json.loads(text)["status"] == "running"
    going.set_status("incomplete", "killed")
    assert json.loads(_run_json(going, text))["status"] == "incomplete"


def test_record_counts_take_the_lost_ones_off_what_was_received(tmp_path: Path) -> None:
    split = _split(tmp_path, 0)
    split.received.update({"a": 100, "b": 50})  # lost ones are counted in received
    split.lost.update({"a": 7})
    split.dropped.update({"a": 3, "b": 2})
    split.rejected = 4
    counts = split.record_counts()
    assert (counts.received, counts.lost, counts.dropped, counts.rejected) == (143, 7, 5, 4)
    assert counts.gpu_not_measured is None  # no GPU used
    assert split.split_dir == tmp_path / "training" / "split-0"
