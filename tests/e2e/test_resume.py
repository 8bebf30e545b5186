"""Checkpoint and resume (docs/contract.md, Semantics and Faults and bad input): a second
process continues the split from the saved state, by the state file (``resume=True``) or
by ``run.state_dict()`` kept in the user's own checkpoint. Every count is checked: epochs
go on, caps keep counting, warmup applies again, Training time adds up, the wall time
shows the downtime and the work redone, GPU names read 'A' then 'B' only when the GPU
changed. Older state schemas are upgraded, newer ones refused with a clear message.
"""

from __future__ import annotations

import json
import re
import signal
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest

import markers
from sidecar.model import state
from tests.support.helpers import progress, run_json, split_dir, start_job, wait_for

WARMUP, CAP, ITERS, VAL_ITERS = 3, 60, 20, 5


def _phases(out: Path) -> pd.DataFrame:
    return pd.read_csv(split_dir(out) / "logs" / "phases.tsv", sep="\t")


def _time_account(summary: str) -> dict[str, float]:
    match = re.search(
        r"Training time: effective (\S+) s over (\d+) sessions?; wall (\S+) s\n"
        r" +including downtime (\S+) s and redone work (\S+) s .*\n"
        r" +and the processes' time before start_run (\S+) s",
        summary,
    )
    assert match, summary
    effective, sessions, wall, downtime, redone, before = match.groups()
    return {
        "effective": float(effective),
        "sessions": int(sessions),
        "wall": float(wall),
        "downtime": float(downtime),
        "redone": float(redone),
        "before": float(before),
    }


def _streaming_count(summary: str, label: str) -> int:
    streaming = summary[summary.index("All post-warmup measurements") :]
    return int(re.search(rf"^\s*{label}\s+\|[^\[]*\[(\d+)\]", streaming, re.M)[1])


def test_resume_after_sigkill_continues_every_count(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "resumed"
    common = [
        "--out-dir",
        str(out),
        "--iters",
        str(ITERS),
        "--val-iters",
        str(VAL_ITERS),
        "--warmup",
        str(WARMUP),
        "--cap",
        str(CAP),
        "--sleep",
        "0.01",
    ]
    first = start_job(
        sidecar.endpoint,
        short_tmp,
        *common,
        "--epochs",
        "1000",
        "--gpu",
        "GPU-a:A",
        "--progress",
        str(short_tmp / "p1.json"),
    )
    wait_for(
        lambda: progress(short_tmp / "p1.json").get("checkpoints_ok", 0) >= 2, 60, "two checkpoints"
    )
    time.sleep(0.3)  # training after the checkpoint: redone after the resume
    killed_unix = time.time()
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    wait_for(lambda: run_json(out).get("status") == "incomplete", 10, "the death noticed")
    saved = json.loads(state.state_path(split_dir(out)).read_text())["ranks"]["0"]
    saved_epochs = len(saved["series"][str(markers.wire.EPOCH)]["rows"]["epoch"])
    saved_iterations = saved["stored_iterations"]["train"]
    saved_counted = saved["series"][str(markers.wire.TRAINING_LOOP)]["wall"][0]
    time.sleep(1.0)  # downtime
    second = start_job(
        sidecar.endpoint,
        short_tmp,
        *common,
        "--epochs",
        "2",
        "--resume",
        "--gpu",
        "GPU-b:B",
        "--progress",
        str(short_tmp / "p2.json"),
    )
    assert second.wait(60) == 0
    elapsed2 = progress(short_tmp / "p2.json")["elapsed_s"]

    document = run_json(out)
    assert document["status"] == "completed"
    assert document["splits"]["0"]["sessions"] == 2
    phases = _phases(out)
    epochs = phases[phases.phase == "Epoch"]
    assert list(epochs.epoch) == list(range(saved_epochs + 2))  # epochs continue
    assert list(epochs.session) == [0] * saved_epochs + [1, 1]
    loop = phases[phases.phase == "Training loop"]
    new_measured = 2 * ITERS - WARMUP
    assert len(loop) == min(CAP, saved_iterations + new_measured)  # the cap counts on
    resumed = loop[loop.session == 1]
    assert len(resumed) == min(CAP - saved_iterations, new_measured)
    assert resumed.batch.min() == WARMUP  # warmup applied again in the new process
    for phase in ("Forward", "Backward", "Optimization"):  # rows stay aligned
        assert list(phases[phases.phase == phase].iteration) == list(loop.iteration)
    summary = (split_dir(out) / "summary.log").read_text()
    assert _streaming_count(summary, " Iteration") == saved_counted + new_measured
    assert "GPU: 'A' then 'B'" in summary
    account = _time_account(summary)
    assert account["sessions"] == 2
    # effective = time saved at the checkpoint + the whole second process
    assert abs(account["effective"] - (saved["training_s"] + elapsed2)) < 0.5
    assert account["downtime"] >= 0.9
    # redone: from the last checkpoint to the kill (the last records came just before it)
    assert abs(account["redone"] - (killed_unix - saved["saved_unix"])) < 0.3
    assert (
        abs(
            account["wall"]
            - (account["effective"] + account["downtime"] + account["redone"] + account["before"])
        )
        < 0.02
    )
    table_training = float(re.search(r"^Training\s+\|\s+(\S+) \[1\]", summary, re.M)[1])
    assert abs(table_training - account["effective"]) < 0.01 * account["effective"] + 0.01


def test_state_dict_round_trip_through_the_training_process(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "own"
    kept = short_tmp / "my-checkpoint.json"
    common = [
        "--out-dir",
        str(out),
        "--iters",
        str(ITERS),
        "--warmup",
        str(WARMUP),
        "--gpu",
        "GPU-x:X",
    ]
    first = start_job(
        sidecar.endpoint,
        short_tmp,
        *common,
        "--epochs",
        "2",
        "--state-out",
        str(kept),
        "--progress",
        str(short_tmp / "p1.json"),
    )
    assert first.wait(60) == 0
    saved = json.loads(kept.read_text())
    assert saved["schema"] == state.SCHEMA
    state.state_path(split_dir(out)).unlink()  # only the user's own copy is left
    second = start_job(
        sidecar.endpoint,
        short_tmp,
        *common,
        "--epochs",
        "1",
        "--state-in",
        str(kept),
        "--progress",
        str(short_tmp / "p2.json"),
    )
    assert second.wait(60) == 0
    phases = _phases(out)
    assert list(phases[phases.phase == "Epoch"].epoch) == [0, 1, 2]
    assert run_json(out)["splits"]["0"]["sessions"] == 2
    summary = (split_dir(out) / "summary.log").read_text()
    assert "GPU: 'X'\n" in summary  # the same GPU twice is named once
    account = _time_account(summary)
    elapsed2 = progress(short_tmp / "p2.json")["elapsed_s"]
    assert abs(account["effective"] - (saved["ranks"]["0"]["training_s"] + elapsed2)) < 0.5
    loop = phases[phases.phase == "Training loop"]
    assert len(loop) == 3 * ITERS - 2 * WARMUP


def test_schema_1_state_file_is_upgraded(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "old"
    common = ["--out-dir", str(out), "--iters", str(ITERS), "--warmup", str(WARMUP)]
    assert start_job(sidecar.endpoint, short_tmp, *common, "--epochs", "1").wait(60) == 0
    path = state.state_path(split_dir(out))
    document = json.loads(path.read_text())
    document["schema"] = 1  # as the first release wrote it
    for key in ("received", "gaps"):
        del document[key]
    for rank in document["ranks"].values():
        for key in ("saved_unix", "downtime_s", "redone_s"):
            del rank[key]
    path.write_text(json.dumps(document))
    assert (
        start_job(sidecar.endpoint, short_tmp, *common, "--epochs", "1", "--resume").wait(60) == 0
    )
    phases = _phases(out)
    assert list(phases[phases.phase == "Epoch"].epoch) == [0, 1]
    assert "starting this split afresh" not in sidecar.log.read_text()


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (99, "schema 99, newer than this sidecar's"),
        ("one", "no valid schema number"),
        (None, "no valid schema number"),
    ],
)
def test_unusable_state_is_refused_with_a_clear_message(
    serve, short_tmp: Path, schema: object, message: str
) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "bad"
    path = state.state_path(split_dir(out))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": schema, "ranks": {}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = markers.start_run(out_dir=str(out), resume=True, endpoint=sidecar.endpoint)
        assert run.monitored  # the run goes on, measured afresh
        assert not run.load_state_dict({"schema": 2, "split": 0})  # lacks fields: refused
        run.finish()
    texts = [str(w.message) for w in caught]
    assert any(message in t and "starting this split afresh" in t for t in texts), texts
    assert any("lacks the field 'settings'" in t for t in texts), texts
    assert not any("KeyError" in t for t in texts)
    assert run_json(out)["status"] == "completed"


def test_upgrade_fills_schema_2_fields() -> None:
    upgraded = state.upgrade(
        {
            "schema": 1,
            "split": 0,
            "settings": {},
            "gpus": [],
            "batch_sizes": {},
            "dropped": {},
            "lost": {},
            "rejected": 0,
            "ranks": {
                "0": {
                    "run_start_unix": 5.0,
                    "sessions": [
                        {"start_unix": 5.0, "start_ns": 0, "last_ns": 2 * 10**9, "end_ns": None}
                    ],
                }
            },
        }
    )
    assert upgraded["schema"] == state.SCHEMA
    assert upgraded["received"] == {} and upgraded["gaps"] == []
    assert upgraded["ranks"]["0"]["saved_unix"] == 7.0
    assert upgraded["ranks"]["0"]["downtime_s"] == upgraded["ranks"]["0"]["redone_s"] == 0.0
