"""The pieces behind the cross-process behaviour, in-process: the batch sizes the markers read,
summary.log rewritten in place with others appending, the state's upgrade and lineage, the split
claim between two holders, resource figures merged over sessions."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from markers.batches import batch_size as _batch_size
from sidecar.ingest.resume import Lineage
from sidecar.model import state
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample
from sidecar.resources.sessions import summarize_gpus_over_sessions, summarize_host_over_sessions
from sidecar.sinks.atomic import rewrite_in_place
from sidecar.sinks.locks import Busy, SplitClaim


class Tensor:
    def __init__(self, *shape: int) -> None:
        self.shape = shape


class Subject(dict):  # type: ignore[type-arg]
    """A sample class of its own, as torchio's Subject (a dict subclass)."""


class Batch(list):  # type: ignore[type-arg]
    """A batch class of its own, as clinicadl's Batch (a list subclass)."""


@pytest.mark.parametrize(
    ("batch", "size"),
    [
        (Tensor(8, 3), 8),
        ((Tensor(8, 3), Tensor(8)), 8),  # (inputs, labels)
        ([Tensor(8, 3), Tensor(8)], 8),  # default_collate of tuple samples gives a list
        ({"input_ids": Tensor(4, 16), "attention_mask": Tensor(4, 16)}, 4),
        ((Tensor(5, 3), ["a.png"] * 5), 5),  # images and their file names
        (["some text"] * 6, 6),
        ([1.0, 2.0, 3.0], 3),  # scalar samples
        # Samples as they are (collate_fn=lambda b: b): their count, not the channels (3)
        # nor the first sample's length.
        ([(Tensor(3, 32, 32), 1)] * 8, 8),
        ([[101, 7, 102]] * 8, 8),
        ([Subject(image=Tensor(1, 8, 8, 8))] * 5, 5),  # a sample class (torchio, clinicadl)
        (Batch([{"x": Tensor(3)}] * 3), 3),  # a batch class of its own (clinicadl's Batch)
        # Plain dicts or lists in a plain list: samples, or the fields of collated tuple
        # samples ((inputs, targets) of dicts): ambiguous.
        ([{"x": Tensor(3)}] * 8, None),
        ([{"x": Tensor(4, 3)}, {"y": Tensor(4)}], None),
        ([[Tensor(4, 3)], [Tensor(4)]], None),
        ((Tensor(8, 3), Tensor(4)), None),  # first dimensions disagree
        (object(), None),
        (Tensor(), None),
        # Beside the shapes read directly (a tensor; a tuple, list or dict of them): a 0-d
        # field, another mapping, nothing at all.
        ({"x": Tensor(4, 3), "loss": Tensor()}, 4),
        (OrderedDict(x=Tensor(4, 3), y=Tensor(4)), 4),
        ({"x": Tensor(4, 3), "y": Tensor(5)}, None),
        ((), None),
    ],
)
def test_batch_size_is_read_only_where_unambiguous(batch: object, size: int | None) -> None:
    assert _batch_size(batch) == size


def test_rewrite_in_place_keeps_the_inode_and_what_others_append(tmp_path: Path) -> None:
    path = tmp_path / "summary.log"
    handler = logging.FileHandler(path)  # mode "a": O_APPEND, as users open it
    logger = logging.getLogger("user-test")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.info("before")
    inode = path.stat().st_ino

    def transform(text: str) -> str:
        logger.info("during")  # another writer appends between our read and our write
        return text.replace("before", "BLOCK") + "ours\n"

    rewrite_in_place(path, transform)
    logger.info("after")
    handler.close()
    assert path.stat().st_ino == inode
    assert path.read_text() == "BLOCK\nours\nduring\nafter\n"


def test_rewrite_in_place_puts_the_old_text_back_when_the_write_fails(tmp_path: Path) -> None:
    path = tmp_path / "summary.log"
    path.write_text("theirs\n")

    def full_disk(handle, _path, data):  # what fits, then ENOSPC
        handle.write(data[:3])
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        rewrite_in_place(path, lambda text: text + "a longer block\n", full_disk)
    assert path.read_text() == "theirs\n"
    with pytest.raises(OSError):
        rewrite_in_place(tmp_path / "new.log", lambda text: "block\n", full_disk)
    assert not (tmp_path / "new.log").exists()  # nothing partial left


def test_a_split_claim_is_exclusive_across_processes_and_dies_with_its_holder(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from sidecar.sinks.locks import SplitClaim; c = SplitClaim(Path(sys.argv[1])); "
            "c.record({'sidecar_pid': 1}); print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(Busy) as busy:
            SplitClaim(tmp_path)
        assert busy.value.holder == {"sidecar_pid": 1}
    finally:
        holder.kill()
        holder.wait()
    claim = SplitClaim(tmp_path)  # the kernel dropped the dead holder's lock
    assert claim.previous == {"sidecar_pid": 1}
    claim.release()


def _lineage_state(rank: int, run_id: str) -> dict:
    """A saved state whose ``rank`` goes back to run ``run_id``."""
    return {"ranks": {str(rank): {"sessions": [{"run_id": run_id}]}}}


def test_a_folder_of_the_split_wide_lock_keeps_its_lineage(tmp_path: Path) -> None:
    # As older versions left a split: one sidecar.lock for the whole split, naming the
    # last run started on each rank. Run "b1" started afresh on rank 0 after run "a0",
    # whose state is the one in the folder; rank 1 last ran "c0".
    split = tmp_path / "maps" / "training" / "split-0"
    split.mkdir(parents=True)
    (split / "sidecar.lock").write_text(
        json.dumps(
            {
                "sidecar_pid": 4242,
                "host": "old-node",
                "ranks": {
                    str(rank): {
                        "run_id": run_id,
                        "lineage": run_id,
                        "start_unix": 1.7e9,
                        "pid": 4300 + rank,
                        "host": "old-node",
                    }
                    for rank, run_id in ((0, "b1"), (1, "c0"))
                },
            }
        )
    )
    lineage = Lineage(SplitClaim)
    key = (tmp_path / "maps", 0)
    for rank in (0, 1):
        lineage.take(key, rank)
    with pytest.raises(state.StateError, match="started afresh"):
        lineage.check(key, _lineage_state(0, "a0"), 0)
    lineage.check(key, _lineage_state(0, "b1"), 0)  # the last run's own state loads
    with pytest.raises(state.StateError):
        lineage.check(key, _lineage_state(1, "a0"), 1)
    lineage.check(key, _lineage_state(1, "c0"), 1)
    # once a rank's own claim file names a run, that one is the last run of the rank
    for claim in lineage.claims.values():
        claim.release()
    (split / "claims" / "rank-0.lock").write_text(
        json.dumps({"ranks": {"0": {"run_id": "d2", "lineage": "a0"}}})
    )
    newer = Lineage(SplitClaim)
    newer.take(key, 0)
    newer.check(key, _lineage_state(0, "a0"), 0)


def _state_2() -> dict:
    row = {
        "wall_s": 0.1,
        "gpu_s": None,
        "peak_mib": None,
        "epoch": 0,
        "iteration": 0,
        "batch": 0,
        "session": 0,
        "start_s": 0.0,
    }
    return {
        "schema": 2,
        "split": 0,
        "settings": {"train_batch_size": None},
        "gpus": [],
        "batch_sizes": {"train": 16},
        "dropped": {},
        "lost": {},
        "rejected": 0,
        "received": {},
        "gaps": [],
        "ranks": {
            "0": {
                "sessions": [{"run_id": "abc"}],
                "series": {"2": {"rows": [dict(row)]}, "4": {"rows": [dict(row)]}},
            }
        },
    }


def test_schema_2_rows_get_the_one_batch_size_and_the_lineage_is_the_first_run() -> None:
    upgraded = state.upgrade(_state_2())
    assert upgraded["schema"] == state.SCHEMA and "batch_sizes" not in upgraded
    series = upgraded["ranks"]["0"]["series"]  # rows as columns since schema 4
    assert series["2"]["rows"]["batch_size"] == [16]  # Training loop
    assert series["4"]["rows"]["batch_size"] == [None]  # Forward: loop rows only
    assert series["4"]["rows"]["wall_s"] == [0.1] and series["4"]["flagged"]["flag"] == []
    assert state.lineage(upgraded, 0) == "abc"
    assert state.lineage(upgraded, 1) == ""


def _gpu(t_s: float, energy_j: float, util: float) -> GpuSample:
    return GpuSample(
        int(t_s * 1e9),
        0,
        "GPU-a",
        "A",
        util,
        10.0,
        100.0,
        1000.0,
        200.0,
        "average",
        energy_j,
        50.0,
        None,
        None,
        None,
        None,
    )


def test_figures_over_sessions_leave_the_downtime_out() -> None:
    # Session 0 from 0 s to 10 s, session 1 from 100 s to 120 s; the energy counter runs on
    # in between (another 5000 J that nobody of this run used).
    samples = [_gpu(0, 0, 10), _gpu(10, 1000, 10), _gpu(100, 6000, 40), _gpu(120, 8000, 40)]
    starts = [0, int(100e9)]
    (merged,) = summarize_gpus_over_sessions(samples, starts)
    assert merged.n_samples == 4 and merged.duration_s == 30
    assert merged.figures["energy_j"] == 1000 + 2000
    assert merged.figures["util_mean_pct"] == pytest.approx((10 * 10 + 40 * 20) / 30)
    host = [
        HostSample(int(t * 1e9), cpu, 100.0 * (1 + t / 100), None, 20.0, 1)
        for t, cpu in ((0, 50), (10, 50), (100, 200), (120, 200))
    ]
    host_summary = summarize_host_over_sessions(host, starts)
    assert host_summary.n_samples == 4
    assert host_summary.figures["cpu_mean_pct"] == pytest.approx((50 * 10 + 200 * 20) / 30)
    assert host_summary.figures["rss_peak_mib"] == pytest.approx(220.0)
