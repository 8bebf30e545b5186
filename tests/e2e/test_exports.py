"""Exports (docs/exports.md), read back with each tool's own reader: a real
``tensorboard`` server (both loaders, through its HTTP data API) and TensorBoard's
``EventAccumulator``, MLflow's ``MlflowClient.get_metric_history`` (a real
``mlflow server`` on 127.0.0.1, and a local file store). Each exported phase series
holds the stored rows of computational.tsv (same count, same values), the host series
those of resources.tsv, and the steps are the optimizer steps across a kill and resume.
Faults: a tracking server stopped mid-run and started again, a folder that refuses the
event file, names that are not exporters.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pandas as pd
import psutil
import pytest

from tests.support.helpers import REPO, env, split_dir, wait_for
from tests.support.prometheus import free_port
from tests.support.tensorboard_server import Scalars, TensorBoard, tensorboard

pytestmark = pytest.mark.e2e
JOB = REPO / "tests" / "support" / "jobs" / "export_job.py"
ITERS, WARMUP = 12, 2
# computational.tsv column -> exported series
SERIES = {
    "Training loop (s)": "phases/train_loop_wall_s",
    "Training data loading (s)": "phases/train_loading_wall_s",
    "Forward (s)": "phases/forward_wall_s",
    "Backward (s)": "phases/backward_wall_s",
    "Optimization (s)": "phases/optimization_wall_s",
    "Validation loop (s)": "phases/val_loop_wall_s",
    "Evaluation (s)": "phases/evaluation_wall_s",
}
VALIDATION = ("Validation loop (s)", "Evaluation (s)")  # several rows at one step


def _command(*args: str, under_run: bool = False, live_s: float | None = None) -> list[str]:
    """The job's command line; ``under_run``: under ``sidecar run`` (its exports wait up
    to 10 s at the end, where a private sidecar's wait 4 s: MLflow alone takes seconds to
    import on a loaded machine); ``live_s``: its live export period (``--export-every``)."""
    job = [sys.executable, str(JOB), "--out-dir", "maps", "--iters", str(ITERS), *args]
    live = ["--export-every", str(live_s)] if live_s is not None else []
    run = [sys.executable, "-m", "sidecar", "run", *live, "--"]
    return [*run, *job] if under_run or live else job


def _job(
    cwd: Path, *args: str, under_run: bool = False, live_s: float | None = None, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _command(*args, under_run=under_run, live_s=live_s),
        cwd=cwd,
        env=env(**extra),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,  # never a terminal: `sidecar run` keeps its job apart
    )


def _stored(out: Path) -> pd.DataFrame:
    return pd.read_csv(split_dir(out) / "logs" / "computational.tsv", sep="\t")


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = tb.EventAccumulator(str(folder), size_guidance={tb.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _same(exported: list[float], stored: pd.Series) -> None:
    values = stored.dropna().tolist()
    assert len(exported) == len(values)
    assert exported == pytest.approx(values, rel=1e-6, abs=1e-9)  # TensorBoard: float32


def _same_values(exported: list[float], stored: pd.Series) -> None:
    """The same values, each as often, in any order: MLflow keeps milliseconds, so points
    of one step ended within the same millisecond (validation iterations) come back in any
    order; two of them may be equal (an Evaluation of a few hundred ns, timed to 10 ns):
    distinct points all the same, each read."""
    assert sorted(exported) == sorted(stored.dropna().tolist())


def test_tensorboard_series_are_the_stored_rows_across_a_kill_and_resume(tmp_path: Path) -> None:
    first = _job(tmp_path, "--export", "tensorboard", "--kill-after-epoch", "0")
    assert first.returncode == -9, first.stderr
    second = _job(tmp_path, "--export", "tensorboard", "--resume", "--epochs", "1")
    assert second.returncode == 0, second.stderr
    out = tmp_path / "maps"
    scalars = _scalars(split_dir(out) / "tensorboard")
    stored = _stored(out)
    for column, tag in SERIES.items():
        _same([value for _, value in scalars[tag]], stored[column])
    # the optimizer steps: 12 per epoch, warmup again after the resume, which goes on at 12
    steps = [step for step, _ in scalars["phases/forward_wall_s"]]
    assert steps == [*range(WARMUP, ITERS), *range(ITERS + WARMUP, 2 * ITERS)]
    resources = pd.read_csv(split_dir(out) / "logs" / "resources.tsv", sep="\t")
    memory = [value for _, value in scalars["CPU/MemUtil_Percent"]]
    _same(memory, resources["system memory used (%)"])
    rss = [value for _, value in scalars["CPU/JobRSS_MiB"]]
    _same(rss, resources["job memory rss (MB)"])
    resource_steps = [step for step, _ in scalars["CPU/MemUtil_Percent"]]
    assert resource_steps == sorted(resource_steps)
    assert resource_steps[0] >= 0 and resource_steps[-1] <= 2 * ITERS - 1
    assert "goodput/productive_s" in scalars
    summary = (split_dir(out) / "summary.log").read_text()
    assert "Export tensorboard:" in summary and "not exported" not in summary


def test_bad_names_and_a_folder_that_refuses_the_event_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")  # the extra trainmon[tensorboard]
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the event folder should be\n")
    done = _job(tmp_path, "--export", "tensorboard,bogus", "--tensorboard-dir", str(blocker / "tb"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("markers: unknown export 'bogus'") == 1, done.stderr
    out = tmp_path / "maps"
    assert len(_stored(out)["Forward (s)"].dropna()) == 2 * ITERS - WARMUP  # nothing lost
    summary = (split_dir(out) / "summary.log").read_text()
    line = next(x for x in summary.splitlines() if x.startswith("Export tensorboard:"))
    assert "0 points" in line and "not exported" in line and "NotADirectoryError" in line


def _crash_and_resume(cwd: Path, *args: str) -> None:
    """Process A checkpoints at step 80 and is killed at step 100, its points after the
    checkpoint exported live (every 0.5 s); B resumes from the checkpoint and trains 40
    steps (80 to 119)."""
    common = ("--epochs", "1", "--cap", "1000", *args)
    first = _job(
        cwd,
        *common,
        *("--iters", "120", "--checkpoint-at", "80", "--kill-at", "100", "--sleep", "0.1"),
        live_s=0.5,
    )
    assert first.returncode == 128 + signal.SIGKILL, first.stderr
    second = _job(cwd, *common, "--iters", "40", "--start-step", "80", "--resume")
    assert second.returncode == 0, second.stderr


def _served(server: TensorBoard, run: str, count: int) -> dict[str, Scalars]:
    """Every exported phase series of ``run`` once the server has loaded ``count``
    forward points (it loads in the background)."""

    def loaded() -> bool:
        tags = server.tags().get(run, [])
        return "phases/forward_wall_s" in tags and (
            len(server.scalars(run, "phases/forward_wall_s")) >= count
        )

    wait_for(loaded, 120, f"tensorboard loading {run}", interval_s=0.5)
    tags = server.tags()[run]
    return {tag: server.scalars(run, tag) for tag in SERIES.values() if tag in tags}


@pytest.mark.timeout(600)
def test_tensorboard_server_shows_each_stored_row_once_after_a_crash_and_resume(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard")
    _crash_and_resume(tmp_path, "--export", "tensorboard")
    out = tmp_path / "maps"
    stored = _stored(out)
    forward = len(stored["Forward (s)"].dropna())
    assert forward > 100  # both sessions' rows (the store's own resume rule)
    run = "training/split-0/tensorboard"
    for load_fast in (True, False):
        with tensorboard(out, load_fast) as server:
            series = _served(server, run, forward)
        for column, tag in SERIES.items():
            points = sorted(series[tag], key=lambda point: point[0])  # stable: same step
            values = [value for _, value in points]
            if load_fast and column in VALIDATION:
                # the Rust loader keeps one point per step of a tag: of the validation
                # iterations (one validation, at one step) only the last (docs/exports.md)
                assert len({step for step, _ in points}) == len(points) == 1, column
                _same(values, stored[column].dropna().tail(1))
            else:
                _same(values, stored[column])
        steps = [step for step, _ in series["phases/forward_wall_s"]]
        assert len(steps) == len(set(steps)) == forward, load_fast  # each step once
        assert steps == sorted(steps) and steps[-1] == 119, load_fast


@pytest.mark.timeout(600)
def test_tensorboard_points_live_beside_the_scripts_own_writer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")  # the script's own SummaryWriter
    folder, pause = tmp_path / "tb", tmp_path / "pause"
    pause.with_suffix(".hold").touch()
    job = subprocess.Popen(
        _command(
            *("--epochs", "1", "--iters", "40", "--export", "tensorboard", "--sleep", "0.01"),
            *("--tensorboard-dir", str(folder), "--own-writer", str(folder)),
            *("--checkpoint-at", "1000", "--hold-at", "30", "--pause-file", str(pause)),
            live_s=0.5,
        ),
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(pause.with_suffix(".reached").exists, 120, "the job's step 30")
        with tensorboard(folder, load_fast=True) as server:
            # while it trains, before any checkpoint: the steps whose records came (the
            # markers send in batches: the last ones may still wait in the script)
            live = _served(server, "trainmon", 10)
        pause.with_suffix(".hold").unlink()
        job.wait(120)
        assert job.returncode == 0, job.stderr.read() if job.stderr else ""
    finally:
        if job.poll() is None:
            job.kill()
    steps = [step for step, _ in live["phases/forward_wall_s"]]
    assert steps == list(range(WARMUP, WARMUP + len(steps))) and steps[-1] < 30
    stored = _stored(tmp_path / "maps")
    for load_fast in (True, False):
        with tensorboard(folder, load_fast) as server:
            series = _served(server, "trainmon", 40 - WARMUP)
            loss = server.scalars(".", "loss")  # the script's own run keeps every point
        _same([value for _, value in series["phases/forward_wall_s"]], stored["Forward (s)"])
        assert [step for step, _ in loss] == list(range(40)), load_fast
    # the sidecar wrote only in its own subfolder
    assert all(p.name == "trainmon" or "tfevents" in p.name for p in folder.iterdir())


def _mlflow_server(store: Path, port: int) -> subprocess.Popen[bytes]:
    mlflow = Path(sys.executable).with_name("mlflow")
    if not mlflow.exists() and shutil.which("mlflow") is None:
        pytest.skip("needs the mlflow command (trainmon[mlflow])")
    server = subprocess.Popen(
        [
            str(mlflow) if mlflow.exists() else "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{store}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            # the run files uploaded at the end go beside the store, not into the cwd
            "--artifacts-destination",
            (store.parent / "artifacts").as_uri(),
        ],
        cwd=store.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def up() -> bool:
        try:  # its /health answers once the app is loaded, not only listening
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    wait_for(up, 180, "mlflow server answering", interval_s=0.5)
    return server


def _stop(server: subprocess.Popen[bytes]) -> None:
    """Stop the server and its workers: SIGTERM, then SIGKILL to whatever is left (on a
    busy machine its graceful stop can take longer than 30 s; a crash is as good here)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(30)


def _history(uri: str, experiment: str) -> dict[str, list[tuple[int, float]]]:
    """Every point of each metric of the experiment's one run as logged, (step, value),
    in step order, then by time (points logged after a retry keep their own time)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    (run,) = client.search_runs([found.experiment_id])
    return {
        key: [
            (step, value)
            for step, _, value in sorted(
                (m.step, m.timestamp, m.value)
                for m in client.get_metric_history(run.info.run_id, key)
            )
        ]
        for key in run.data.metrics
    }


def _logged(uri: str, experiment: str, key: str) -> int:
    """How many points of metric ``key`` the run of ``experiment`` holds yet."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found is not None else []
    return len(client.get_metric_history(runs[0].info.run_id, key)) if runs else 0


def _wait_logged(uri: str, experiment: str, what: str) -> None:
    """Wait until the run of ``experiment`` holds forward points."""
    wait_for(lambda: _logged(uri, experiment, "phases/forward_wall_s"), 120, what, interval_s=0.5)


# two starts of a real MLflow server: a minute or more each on a busy 2-core machine
@pytest.mark.timeout(900)
def test_mlflow_server_stopped_mid_run_then_started_again(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    port = free_port()
    store = tmp_path / "mlflow.db"
    uri = f"http://127.0.0.1:{port}"
    server = _mlflow_server(store, port)
    pause = tmp_path / "pause"
    for epoch in (0, 1):
        pause.with_suffix(f".hold{epoch}").touch()
    job = subprocess.Popen(
        _command(
            *("--epochs", "3", "--export", "mlflow", "--pause-file", str(pause)),
            *("--mlflow-experiment", "faults"),
            under_run=True,
        ),
        cwd=tmp_path,
        env=env(MLFLOW_TRACKING_URI=uri),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    out = tmp_path / "maps"
    try:
        wait_for(pause.with_suffix(".reached0").exists, 120, "the first checkpoint")
        _wait_logged(uri, "faults", "the first checkpoint's points on the server")
        _stop(server)  # the second epoch's checkpoint is exported while the server is away
        pause.with_suffix(".hold0").unlink()
        wait_for(pause.with_suffix(".reached1").exists, 120, "the second checkpoint")
        server = _mlflow_server(store, port)
        # retried while the run goes on (the end's short wait is not needed for them)
        wait_for(
            lambda: _logged(uri, "faults", "phases/forward_wall_s") >= 2 * ITERS - WARMUP,
            120,
            "the second epoch's points retried onto the server",
            interval_s=0.5,
        )
        pause.with_suffix(".hold1").unlink()
        job.wait(120)
        assert job.returncode == 0, job.stderr.read() if job.stderr else ""
        history = _history(uri, "faults")
    finally:
        if job.poll() is None:
            job.kill()
        _stop(server)
    stored = _stored(out)
    # each point once: a request sent again after the server went away repeats the same
    # points (name, step, ms, value), which its SQL store keeps once (docs/exports.md)
    for column, key in SERIES.items():
        _same_values([value for _, value in history[key]], stored[column])
    assert [s for s, _ in history["phases/forward_wall_s"]] == list(range(WARMUP, 3 * ITERS))
    summary = (split_dir(out) / "summary.log").read_text()
    line = next(x for x in summary.splitlines() if x.startswith("Export mlflow:"))
    assert "not exported" not in line and "failed attempts, all retried" in line, line


def test_mlflow_points_go_into_the_scripts_active_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's local file store
    uri = f"file://{tmp_path / 'mlruns'}"
    done = _job(
        tmp_path,
        "--export",
        "mlflow",
        "--mlflow-run",
        MLFLOW_TRACKING_URI=uri,
        MLFLOW_ALLOW_FILE_STORE="true",
    )
    assert done.returncode == 0, done.stderr
    history = _history(uri, "Default")
    assert "loss" in history  # the script's own metric: the same run
    out = tmp_path / "maps"
    line = next(
        x
        for x in (split_dir(out) / "summary.log").read_text().splitlines()
        if x.startswith("Export mlflow:")
    )
    # a local store: no request failed, so no point was logged twice
    assert "not exported" not in line and "failed attempts" not in line, line
    stored = _stored(out)
    for column, key in SERIES.items():
        _same_values([value for _, value in history[key]], stored[column])
    assert [s for s, _ in history["phases/forward_wall_s"]] == list(range(WARMUP, 2 * ITERS))
    assert "system/system_memory_usage_percentage" in history
    assert "goodput/productive_s" in history


def _answered_all(port: int) -> bool:
    """No connection to the server's port is still open on its side: every request that
    waited while it was stopped, accepted or still in its backlog, has been answered and
    closed (what is left lingers in TIME_WAIT or LAST_ACK, closed by the server)."""
    waiting = (psutil.CONN_ESTABLISHED, psutil.CONN_CLOSE_WAIT, psutil.CONN_SYN_RECV)
    return not any(
        c.status in waiting
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port
    )


def _count(line: str, what: str) -> int:
    """The number before ``what`` in a summary line (0 when it does not say)."""
    found = re.search(rf"(\d+) {what}", line)
    return int(found.group(1)) if found else 0


@pytest.mark.timeout(900)
def test_mlflow_counts_match_the_store_after_a_server_that_stopped_answering(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow")
    port = free_port()
    store, pause = tmp_path / "mlflow.db", tmp_path / "pause"
    uri = f"http://127.0.0.1:{port}"
    server = _mlflow_server(store, port)
    pause.with_suffix(".hold").touch()
    job = subprocess.Popen(
        _command(
            *("--epochs", "1", "--iters", "40", "--export", "mlflow", "--sleep", "0.01"),
            *("--mlflow-experiment", "counts", "--checkpoint-at", "1000"),
            *("--hold-at", "30", "--pause-file", str(pause)),
            live_s=0.5,
        ),
        cwd=tmp_path,
        env=env(MLFLOW_TRACKING_URI=uri),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(pause.with_suffix(".reached").exists, 120, "the job's step 30")
        # readable while it trains, before any checkpoint
        _wait_logged(uri, "counts", "live points on the server")
        # the server stops answering (accepted connections wait, unanswered): the
        # requests of the rest of the run time out, and may be applied once it goes on
        os.killpg(server.pid, signal.SIGSTOP)
        pause.with_suffix(".hold").unlink()
        job.wait(180)
        assert job.returncode == 0, job.stderr.read() if job.stderr else ""
        os.killpg(server.pid, signal.SIGCONT)
        wait_for(lambda: _answered_all(port), 120, "the server's answers to what waited")
        held = sum(len(points) for points in _history(uri, "counts").values())
    finally:
        if job.poll() is None:
            job.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGCONT)
        _stop(server)
    summary = (split_dir(tmp_path / "maps") / "summary.log").read_text()
    line = next(x for x in summary.splitlines() if x.startswith("Export mlflow:"))
    exported, unconfirmed = _count(line, "points exported"), _count(line, "not confirmed")
    assert unconfirmed > 0, line  # timed out: never counted as lost
    assert exported <= held <= exported + unconfirmed, (held, line)
