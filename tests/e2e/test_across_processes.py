"""Across processes and resumes (docs/contract.md: Files, Semantics "One writer per rank", Faults):
every item through real processes as a user runs them — folds in parallel under two
``sidecar run``, the user's own logger on summary.log, resume chains, states of cap
10 000, a second writer of a split, batch sizes that change, ``sys.exit``, a plain
``python train.py``. The job is ``tests/support/jobs/user_job.py``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pytest

import markers
from markers import wire
from sidecar.model import state
from sidecar.sinks import summary as summary_text
from tests.support.helpers import (
    REPO,
    env,
    progress,
    run_json,
    sidecar_command,
    split_dir,
    status,
    wait_for,
)

USER_JOB = REPO / "tests" / "support" / "jobs" / "user_job.py"


def job(
    cwd: Path,
    *args: str,
    endpoint: str | None = None,
    under_run: bool = False,
    seams: Sequence[str] = (),
    **popen: object,
) -> subprocess.Popen[str]:
    """``user_job.py ARGS`` under ``sidecar run`` (``under_run``, with the launcher's
    ``seams``), talking to the sidecar at ``endpoint``, or as a plain ``python train.py``
    (neither: a private sidecar)."""
    command = [sys.executable, str(USER_JOB), *args]
    if under_run:
        command = sidecar_command(
            "run", "--quiet", "--interval", "0.2", "--", *command, seams=seams
        )
    environment = env(SIDECAR_ENDPOINT=endpoint) if endpoint else env()
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )  # type: ignore[call-overload]


def finished(process: subprocess.Popen[str], timeout_s: float = 120) -> str:
    """Wait for ``process``; assert it succeeded; return its stderr."""
    _, stderr = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, stderr
    return stderr


def warnings_about(stderr: str, text: str) -> int:
    """How many of the job's RuntimeWarnings (not the sidecar's log lines) say ``text``."""
    return sum(1 for line in stderr.splitlines() if "RuntimeWarning" in line and text in line)


def phases(out: Path, split: int = 0) -> pd.DataFrame:
    return pd.read_csv(split_dir(out, split) / "logs" / "phases.tsv", sep="\t")


def summary_of(out: Path, split: int = 0) -> str:
    return (split_dir(out, split) / "summary.log").read_text()


def throughput(summary: str) -> float:
    return float(re.search(r"^Throughput: (\S+) images/s", summary, re.M)[1])


# -- run.json and split folders written by several sidecars at once -----------------------


def test_folds_in_parallel_under_two_sidecar_runs_keep_every_split(short_tmp: Path) -> None:
    for trial in range(4):
        cwd = short_tmp / f"trial{trial}"
        cwd.mkdir()
        folds = [
            job(cwd, "--split", str(k), "--iters", "6", "--sleep", "0.001", under_run=True)
            for k in (0, 1)
        ]
        for fold in folds:
            finished(fold)
        document = run_json(cwd / "maps")
        assert {k: e["status"] for k, e in document["splits"].items()} == {
            "0": "completed",
            "1": "completed",
        }, trial
        assert document["status"] == "completed"
        entries = document["splits"].values()
        assert document["start"] == min(e["start"] for e in entries)
        assert document["end"] == max(e["end"] for e in entries)
        for k in (0, 1):
            assert len(phases(cwd / "maps", k).query("phase == 'Epoch'")) == 2


def test_run_json_top_level_is_the_worst_split(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "kfold"
    failing = job(
        short_tmp,
        "--out-dir",
        str(out),
        "--split",
        "0",
        "--fail-at-epoch",
        "1",
        endpoint=sidecar.endpoint,
    )
    assert failing.wait(60) == 1
    finished(job(short_tmp, "--out-dir", str(out), "--split", "1", endpoint=sidecar.endpoint))
    document = run_json(out)
    assert document["splits"]["0"]["status"] == "failed"
    assert document["splits"]["1"]["status"] == "completed"
    assert document["status"] == "failed"
    assert document["cause"] == "RuntimeError: boom in epoch 1"
    assert document["start"] == document["splits"]["0"]["start"]  # fold 0 began first
    assert document["end"] == document["splits"]["1"]["end"]  # fold 1 ended last


# -- one writer per split -------------------------------------------------------------------


def test_second_writer_of_a_split_is_refused_under_another_sidecar(short_tmp: Path) -> None:
    stop = short_tmp / "stop"
    first = job(
        short_tmp,
        "--iters",
        "8",
        "--stop-file",
        str(stop),
        "--progress",
        str(short_tmp / "p1.json"),
        under_run=True,
    )
    wait_for(lambda: progress(short_tmp / "p1.json").get("epochs") == 2, 60, "the first run")
    second_stderr = finished(job(short_tmp, "--iters", "30", under_run=True))
    assert warnings_about(second_stderr, "one writer per split") == 1, second_stderr
    stop.touch()
    finished(first)
    out = short_tmp / "maps"
    loop = phases(out).query("phase == 'Training loop'")
    assert len(loop) == 2 * 8 - 1  # the first run's rows only (warmup 1), none of the second's
    assert run_json(out)["splits"]["0"]["sessions"] == 1
    assert run_json(out)["status"] == "completed"


def test_second_writer_of_a_split_is_refused_under_the_same_sidecar(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "same"
    stop = short_tmp / "stop"
    first = job(
        short_tmp,
        "--out-dir",
        str(out),
        "--stop-file",
        str(stop),
        "--progress",
        str(short_tmp / "p1.json"),
        endpoint=sidecar.endpoint,
    )
    wait_for(lambda: progress(short_tmp / "p1.json").get("epochs") == 2, 60, "the first run")
    second_stderr = finished(
        job(short_tmp, "--out-dir", str(out), "--iters", "30", endpoint=sidecar.endpoint)
    )
    assert warnings_about(second_stderr, "one writer per split") == 1, second_stderr
    stop.touch()
    finished(first)
    assert len(phases(out).query("phase == 'Training loop'")) == 2 * 10 - 1


def test_a_dead_sidecars_claim_is_taken_over(short_tmp: Path) -> None:
    stop = short_tmp / "stop"
    first = job(
        short_tmp,
        "--stop-file",
        str(stop),
        "--progress",
        str(short_tmp / "p1.json"),
        under_run=True,
    )
    state = short_tmp / "maps" / "training" / "split-0" / "sidecar-state.json"
    # The trainer's progress can run ahead of a loaded sidecar: its checkpointed state is
    # what the resume continues from.
    wait_for(
        lambda: progress(short_tmp / "p1.json").get("epochs") == 2 and state.exists(),
        60,
        "the first run and its checkpointed state",
    )
    first.send_signal(signal.SIGKILL)  # the sidecar of `sidecar run`: its lock goes with it
    first.wait(10)
    trainer = progress(short_tmp / "p1.json")["pid"]
    subprocess.run(["kill", "-9", str(trainer)], check=False)
    stderr = finished(job(short_tmp, "--resume", under_run=True))
    assert "one writer per split" not in stderr
    document = run_json(short_tmp / "maps")
    assert document["status"] == "completed" and document["splits"]["0"]["sessions"] == 2


# -- summary.log shared with the user's own logger -----------------------------------------


def test_the_users_file_handler_keeps_every_line(short_tmp: Path) -> None:
    finished(job(short_tmp, "--epochs", "4", "--user-log", under_run=True))
    text = summary_of(short_tmp / "maps")
    user_lines = [line for line in text.splitlines() if line.startswith("user line:")]
    assert user_lines == [
        f"user line: epoch {e} {what}" for e in range(4) for what in ("trained", "checkpointed")
    ]
    lines = text.splitlines()
    assert lines.count(summary_text.TITLE_LINE) == 1  # our block once
    start = lines.index(summary_text.TITLE_LINE)
    end = next(
        i
        for i in range(lines.index(summary_text.RESOURCES, start), len(lines))
        if lines[i] == summary_text.STARS
    )
    assert not any(line.startswith("user line:") for line in lines[start : end + 1])  # whole
    assert "Records: received" in "\n".join(lines[start : end + 1])


# -- resume lineage -------------------------------------------------------------------------


def test_resume_takes_only_the_state_of_the_same_lineage(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "chain"
    common = ["--out-dir", str(out)]
    finished(job(short_tmp, *common, endpoint=sidecar.endpoint))  # A: checkpoints
    run_a = json.loads(state.state_path(split_dir(out)).read_text())["ranks"]["0"]["sessions"][0][
        "run_id"
    ]
    b = job(short_tmp, *common, "--fail-at-epoch", "0", endpoint=sidecar.endpoint)
    assert b.wait(60) == 1  # B: started afresh, died before its first checkpoint
    stderr = finished(job(short_tmp, *common, "--resume", endpoint=sidecar.endpoint))  # C
    assert warnings_about(stderr, f"belongs to run {run_a[:8]}") == 1, stderr
    assert "starting this split afresh" in stderr
    epochs = phases(out).query("phase == 'Epoch'")
    assert list(epochs.epoch) == [0, 1] and set(epochs.session) == {0}  # not after A's
    assert run_json(out)["splits"]["0"]["sessions"] == 1


def test_a_resume_that_died_keeps_the_lineage(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "chain"
    common = ["--out-dir", str(out)]
    finished(job(short_tmp, *common, endpoint=sidecar.endpoint))  # A
    c = job(short_tmp, *common, "--resume", "--fail-at-epoch", "0", endpoint=sidecar.endpoint)
    assert c.wait(60) == 1  # C resumed A, died before a checkpoint of its own
    stderr = finished(job(short_tmp, *common, "--resume", endpoint=sidecar.endpoint))  # D
    assert "belongs to run" not in stderr and "afresh" not in stderr, stderr
    assert list(phases(out).query("phase == 'Epoch'").epoch) == [0, 1, 2, 3]


# -- states of any size; checkpoint and state calls kept out of the iteration --------------


def test_a_state_of_cap_25000_travels_and_checkpoint_returns_at_once(
    serve, short_tmp: Path
) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "big"
    kept = short_tmp / "kept.json"
    # 25 000 iterations: a state over the socket cap (rows as columns: ~200 B an iteration)
    common = [
        "--out-dir",
        str(out),
        "--cap",
        "25000",
        "--iters",
        "25000",
        "--sleep",
        "0",
        "--warmup",
        "0",
        "--epochs",
        "1",
        "--give-batch-size",
    ]
    finished(
        job(
            short_tmp,
            *common,
            "--state-out",
            str(kept),
            "--state-in-loop",
            "5000",
            "--progress",
            str(short_tmp / "p1.json"),
            endpoint=sidecar.endpoint,
        ),
        300,
    )
    assert kept.stat().st_size > wire.MAX_MESSAGE_BYTES  # over the socket cap: in parts
    first = progress(short_tmp / "p1.json")
    assert first["max_checkpoint_s"] < 0.5  # the state is taken; writing comes after
    assert first["state_in_loop_s"] > 0.02  # a measurable call ...
    loop = phases(out).query("phase == 'Training loop'").reset_index()
    # ... kept out of the iteration it was made in (the row holds the sleep(0) step only)
    assert loop.loc[5000, "wall (s)"] < first["state_in_loop_s"] / 2
    stderr = finished(
        job(short_tmp, *common, "--state-in", str(kept), endpoint=sidecar.endpoint), 300
    )
    assert "not loaded" not in stderr, stderr
    document = run_json(out)
    assert document["status"] == "completed" and document["splits"]["0"]["sessions"] == 2
    epochs = phases(out).query("phase == 'Epoch'")
    assert list(epochs.epoch) == [0, 1] and list(epochs.session) == [0, 1]
    counted = re.search(
        r"^\s+Iteration\s+\|[^\[]*\[(\d+)\]",
        summary_of(out).split("All post-warmup measurements")[1],
        re.M,
    )
    assert int(counted[1]) == 50000  # the resumed session's records all arrived


def test_finish_waits_while_the_sidecar_writes_and_gives_up_when_it_is_stuck(
    serve, short_tmp: Path
) -> None:
    sidecar = serve(seams=["--slow-disk", "0.25"])  # each file takes 0.25 s: 1.5 s in all
    out = short_tmp / "root" / "slow"
    common = ["--out-dir", str(out), "--finish-timeout", "0.6", "--progress"]
    stderr = finished(
        job(short_tmp, *common, str(short_tmp / "p1.json"), endpoint=sidecar.endpoint), 120
    )
    assert "did not confirm" not in stderr, stderr
    assert run_json(out)["status"] == "completed"
    # The write outlasted the 0.6 s wait without news: the progress kept finish() waiting.
    assert progress(short_tmp / "p1.json")["finish_s"] > 1.0
    stop = short_tmp / "stop"
    stuck = job(
        short_tmp,
        *common,
        str(short_tmp / "p2.json"),
        "--stop-file",
        str(stop),
        "--resume",
        endpoint=sidecar.endpoint,
    )
    wait_for(lambda: "elapsed_s" in progress(short_tmp / "p2.json"), 120, "training done")
    sidecar.process.send_signal(signal.SIGSTOP)
    try:
        stop.touch()
        begin = time.monotonic()
        _, stderr = stuck.communicate(timeout=30)
        waited_s = time.monotonic() - begin
    finally:
        sidecar.process.send_signal(signal.SIGCONT)
    assert "no answer and no progress within 0.6 s" in stderr, stderr
    assert waited_s < 5.0


# -- resources over every session ----------------------------------------------------------


def test_resources_accumulate_across_sessions(short_tmp: Path) -> None:
    # Each process under a `sidecar run` of its own: the second sidecar never saw session 0.
    common = ["--iters", "40", "--sleep", "0.02", "--epochs", "2"]
    finished(job(short_tmp, *common, under_run=True, seams=["--fake-nvml", "two_busy_gpus"]))
    finished(
        job(short_tmp, *common, "--resume", under_run=True, seams=["--fake-nvml", "two_busy_gpus"])
    )
    out = short_tmp / "maps"
    logs = split_dir(out) / "logs"
    frame = pd.read_csv(logs / "resources.tsv", sep="\t")
    assert set(frame.session) == {0, 1}
    summary = summary_of(out)
    for index in (0, 1):
        gpu = frame[frame["gpu index"] == index]
        line = re.search(rf"^GPU {index}: .*\((\d+) samples over", summary, re.M)
        assert int(line[1]) == len(gpu)  # every session's samples
        energy = sum(
            g["energy (J)"].iloc[-1] - g["energy (J)"].iloc[0] for _, g in gpu.groupby("session")
        )
        shown = float(re.findall(r"Energy \(J\)\s+(\S+) \(counter\)", summary)[index])
        assert energy > 0 and abs(shown - energy) <= 0.005 * energy  # the downtime left out
    host = frame.drop_duplicates("time (s)")
    assert f"Host: job processes ({len(host)} samples)" in summary
    received = int(re.search(r"Records: received (\d+)", summary)[1])
    assert received >= len(phases(out))  # both sessions' records (stored rows are fewer)
    assert received > 2 * 40 * 3  # more than one session's worth
    # `sidecar report` reads the same sessions the same way
    report = subprocess.run(
        sidecar_command("report", str(out), "--out", str(short_tmp / "r")),
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    row = pd.read_csv(short_tmp / "r" / "jobs.tsv", sep="\t").iloc[0]
    energies = [float(e) for e in re.findall(r"Energy \(J\)\s+(\S+) \(counter\)", summary)]
    assert abs(row["energy (kWh)"] - sum(energies) / 3.6e6) <= 1e-3 * row["energy (kWh)"]
    utils = [float(u) for u in re.findall(r"Utilization \(%\) +mean ([0-9.]+)", summary)]
    assert abs(row["GPU utilization mean (%)"] - sum(utils) / len(utils)) <= 0.051


# -- batch sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("given", [True, False], ids=["given", "read"])
def test_a_batch_size_that_changes_across_a_resume_counts_per_row(
    serve, short_tmp: Path, given: bool
) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "sizes"
    common = ["--out-dir", str(out), "--iters", "12"] + (["--give-batch-size"] if given else [])
    finished(job(short_tmp, *common, "--batch-size", "8", endpoint=sidecar.endpoint))
    finished(job(short_tmp, *common, "--batch-size", "32", "--resume", endpoint=sidecar.endpoint))
    loop = phases(out).query("phase == 'Training loop'")
    assert set(zip(loop.session, loop["batch size"], strict=True)) == {(0, 8), (1, 32)}
    expected = loop["batch size"].sum() / loop["wall (s)"].sum()
    assert abs(throughput(summary_of(out)) - expected) <= 0.01 * expected


def test_ambiguous_batches_warn_once_and_leave_throughput_unknown(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "dicts"
    stderr = finished(
        job(short_tmp, "--out-dir", str(out), "--shape", "dicts", endpoint=sidecar.endpoint)
    )
    assert warnings_about(stderr, "batch size cannot be read") == 1, stderr
    assert "Throughput: unknown" in summary_of(out)
    assert "images/s" not in summary_of(out).split("Validation")[0]


@pytest.mark.parametrize("shape", ["tuples", "tokens"])
def test_a_list_of_samples_gives_its_length(serve, short_tmp: Path, shape: str) -> None:
    sidecar = serve()
    out = short_tmp / "root" / shape
    stderr = finished(
        job(
            short_tmp,
            *("--out-dir", str(out), "--shape", shape, "--batch-size", "6"),
            endpoint=sidecar.endpoint,
        )
    )
    assert "cannot be read" not in stderr
    assert set(phases(out).query("phase == 'Training loop'")["batch size"]) == {6}


def test_a_tuple_of_tensors_gives_its_batch_size(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "tensor"
    stderr = finished(
        job(short_tmp, "--out-dir", str(out), "--batch-size", "16", endpoint=sidecar.endpoint)
    )
    assert "cannot be read" not in stderr
    assert set(phases(out).query("phase == 'Training loop'")["batch size"]) == {16}


# -- how a run starts and ends ----------------------------------------------------------------


def test_training_time_starts_when_the_private_sidecar_is_ready(short_tmp: Path) -> None:
    finished(
        job(
            short_tmp,
            "--epochs",
            "1",
            "--iters",
            "20",
            "--sleep",
            "0.02",
            "--progress",
            str(short_tmp / "p.json"),
        )
    )  # plain python train.py
    elapsed_s = progress(short_tmp / "p.json")["elapsed_s"]
    training_s = float(
        re.search(r"^Training\s+\|\s+(\S+) \[1\]", summary_of(short_tmp / "maps"), re.M)[1]
    )
    # The private sidecar's start-up (about 0.5 s here) is not training.
    assert elapsed_s - 0.05 < training_s < elapsed_s + 0.15


@pytest.mark.parametrize(("code", "expected"), [(0, "completed"), (3, "failed")])
def test_sys_exit_inside_the_run(serve, short_tmp: Path, code: int, expected: str) -> None:
    sidecar = serve()
    out = short_tmp / "root" / f"exit{code}"
    process = job(short_tmp, "--out-dir", str(out), "--exit", str(code), endpoint=sidecar.endpoint)
    assert process.wait(60) == code
    document = run_json(out)
    assert document["status"] == expected
    assert document["cause"] == (None if code == 0 else f"SystemExit: {code}")


@pytest.mark.parametrize(
    ("ending", "code", "status", "cause"),
    [
        ("sys.exit(3)", 3, "failed", "SystemExit: 3"),
        ("sys.exit('disk full')", 1, "failed", "SystemExit: disk full"),
        ("sys.exit(0)", 0, "completed", None),
        ("pass", 0, "completed", None),
        ("raise ValueError('bad')", 1, "failed", "ValueError: bad"),
    ],
)
def test_a_run_left_open_ends_by_the_exit_status(
    serve, short_tmp: Path, ending: str, code: int, status: str, cause: str | None
) -> None:
    """Without ``with run`` (and no finish()), the same rule as inside it."""
    sidecar = serve()
    out = short_tmp / "root" / "open"
    script = (
        "import sys, markers\n"
        f"run = markers.start_run(out_dir={str(out)!r}, warmup_iterations=0)\n"
        "for _ in run.train_batches([[1, 2]] * 3):\n"
        "    pass\n"
        f"{ending}\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", script],
        cwd=short_tmp,
        env=env(SIDECAR_ENDPOINT=sidecar.endpoint),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == code, process.stderr
    document = run_json(out)
    assert (document["status"], document["cause"]) == (status, cause)


def test_a_keyboard_interrupt_the_user_handled_ends_the_run_completed(
    serve, short_tmp: Path
) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "ctrl-c"
    finished(
        job(
            short_tmp,
            "--out-dir",
            str(out),
            "--interrupt-at",
            "4",
            "--progress",
            str(short_tmp / "p.json"),
            endpoint=sidecar.endpoint,
        )
    )
    assert progress(short_tmp / "p.json")["interrupted"]
    assert run_json(out)["status"] == "completed"
    assert len(phases(out).query("phase == 'Epoch'")) == 1


# -- the wire -------------------------------------------------------------------------------


def test_the_markers_survive_a_dropped_connection(serve, short_tmp: Path) -> None:
    sidecar = serve()
    out = short_tmp / "root" / "dropped"
    run = markers.start_run(
        out_dir=str(out), warmup_iterations=0, train_batch_size=2, endpoint=sidecar.endpoint
    )
    big = {"type": "phase", "pad": "y" * wire.MAX_MESSAGE_BYTES}
    assert not run._sender.send_control(big)  # never sent: it would cost the connection
    with run, run.epoch():
        for i, _ in enumerate(run.train_batches(range(40))):
            if i == 10:  # a frame over the cap anyway: ZeroMQ drops the connection
                run._sender._socket.send(
                    wire.encode_control(run._sender._header(wire.KIND_CONTROL), big)
                )
                wait_for(
                    lambda: status(sidecar.endpoint)["rejected_by_kind"].get("connection_dropped"),
                    20,
                    "the drop",
                )
            with run.phase("forward"):
                time.sleep(0.001)
    assert run_json(out)["status"] == "completed"
    assert len(phases(out).query("phase == 'Training loop'")) == 40  # none lost


def test_status_says_what_window_its_rate_covers(serve) -> None:
    sidecar = serve()
    result = subprocess.run(
        sidecar_command("status", "--endpoint", sidecar.endpoint),
        capture_output=True,
        text=True,
        env=env(),
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"records \d+ \(\d+/s, mean over the last \d+\.\d s\)", result.stdout)
