"""Users kept apart on a shared node daemon (docs/contract.md, Faults and bad input and Node
daemon), with two real local users the test creates (``useradd``; removed at the end): each one's
runs land under its own ``ROOT/<user>/``, owned by it and closed to the other; a job naming the
other user's folder is refused and told so; the user is the kernel's, not the one the hello claims;
each sees only its own runs; the Slurm epilog's ``sidecar finish --job`` ends a job's runs; a Slurm
job id is kept only for a process started with it in its environment (a forged one is
dropped, counted, and its epilog ends nothing); a daemon that is not shared refuses other
users even when its socket is left open. Needs root.

Most jobs are forked from this test process and switch to the user (the interpreter may
lie in a folder the test users cannot enter, e.g. /root/.pyenv); the one whose job id is
believed is started with its own environment, by Debian's Python.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import markers
from markers.transport import Sender
from tests.support import local_users
from tests.support.helpers import env, run_json, sidecar_command, status, status_text, wait_for
from tests.support.jobs.loop_job import Batch

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="the two-user test needs root and useradd (it creates two local users)",
)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[str, str]]:
    """Two fresh local users (no home, no login shell); deleted afterwards."""
    names = (f"tm{os.getpid()}a", f"tm{os.getpid()}b")
    for name in names:
        subprocess.run(
            ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
            timeout=60,
        )
    try:
        yield names
    finally:
        for name in names:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)


def as_user(user: str, work: Any, *args: Any) -> dict[str, Any]:
    """Run ``work(*args)`` in a child process switched to ``user``; returns its result
    (a JSON-able dict), or {"error": ...} when it raised."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read_end)
            account = pwd.getpwnam(user)
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            try:
                result = work(*args)
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read()
    os.waitpid(child, 0)
    return json.loads(text)


def train(endpoint: str, out_dir: str, job_id: str, stop_file: str | None = None) -> dict:
    """A monitored loop (until ``stop_file`` exists, if given); what start_run said."""
    os.environ["SLURM_JOB_ID"] = job_id
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = markers.start_run(out_dir=out_dir, endpoint=endpoint, warmup_iterations=0)
    deadline = time.monotonic() + 60
    with run:
        while True:
            with run.epoch():
                for _ in run.train_batches([Batch(4)] * 5):
                    with run.phase("forward"):
                        pass
            if stop_file is None or Path(stop_file).exists() or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    return {
        "monitored": run.monitored,
        "out_dir": str(run.out_dir),
        "warnings": [str(w.message) for w in caught],
    }


def try_files(folder: str) -> dict[str, str]:
    """What happens when this user lists, reads and writes in ``folder``."""
    outcome = {}
    for what, act in (
        ("list", lambda: os.listdir(folder)),
        ("write", lambda: Path(folder, "intruder").write_text("x")),
    ):
        try:
            act()
            outcome[what] = "allowed"
        except PermissionError:
            outcome[what] = "denied"
    return outcome


def runs_seen(endpoint: str) -> dict[str, Any]:
    """The users of the runs this user's status view shows."""
    sender = Sender(endpoint, bytes(16), 0)
    try:
        reply = sender.request({"type": "status"}, 5.0, connect_timeout_s=5.0) or {}
    finally:
        sender.close()
    return {
        "users": sorted({run["user"] for run in reply.get("runs", [])}),
        "error": reply.get("error"),
    }


def _daemon(short_tmp: Path, *args: str) -> subprocess.Popen[bytes]:
    log = (short_tmp / "sidecar.log").open("ab")
    return subprocess.Popen(
        sidecar_command(
            "serve",
            "--endpoint",
            f"ipc://{short_tmp}/s.sock",
            "--root",
            str(short_tmp / "root"),
            *args,
        ),
        env=env(),
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )


def _owners(folder: Path) -> set[int]:
    return {path.lstat().st_uid for path in [folder, *folder.rglob("*")]}


def _job_of_alice(
    user: str,
    short_tmp: Path,
    endpoint: str,
    stop_file: Path,
) -> subprocess.Popen[bytes]:
    """A training loop of ``user`` started, as Slurm would, with ``SLURM_JOB_ID=41`` in
    its environment (Debian's Python and a readable copy of the markers)."""
    site = local_users.readable_markers(short_tmp / "py")
    return subprocess.Popen(
        [
            "runuser",
            "-u",
            user,
            "--",
            local_users.SYSTEM_PYTHON,
            "-m",
            "jobs.loop_job",
            "--out-dir",
            "maps-a",
            "--stop-file",
            str(stop_file),
            "--sleep",
            "0.01",
        ],
        cwd=short_tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(site),
            "SIDECAR_ENDPOINT": endpoint,
            "SLURM_JOB_ID": "41",
        },
    )


@pytest.mark.skipif(
    bool(local_users.user_python_unavailable()), reason=str(local_users.user_python_unavailable())
)
def test_two_users_are_kept_apart(users: tuple[str, str], short_tmp: Path) -> None:
    alice, bob = users
    uid = {name: pwd.getpwnam(name).pw_uid for name in users}
    short_tmp.chmod(0o755)
    root = short_tmp / "root"
    root.mkdir(mode=0o755)
    endpoint = f"ipc://{short_tmp}/s.sock"
    daemon = _daemon(short_tmp, "--shared")
    stop_file = short_tmp / "stop"
    long_job = forged = None
    try:
        wait_for(lambda: status(endpoint, 0.5), 30, "the shared daemon to answer")
        assert (short_tmp / "s.sock").stat().st_mode & 0o777 == 0o666
        # alice trains (job 41) while bob runs a short job and then tries her folder
        long_job = _job_of_alice(alice, short_tmp, endpoint, stop_file)
        theirs = root / alice
        wait_for(
            lambda: any(r["job_id"] == "41" for r in status(endpoint, 2)["runs"]), 30, "alice's run"
        )
        # bob's jobs claim Slurm jobs they do not belong to (no SLURM_JOB_ID in their
        # environment): the ids are dropped, and the epilog of 666 leaves the run alone
        forged = os.fork()
        if forged == 0:
            try:
                as_user(bob, train, endpoint, "maps-f", "666", str(stop_file))
            finally:
                os._exit(0)
        wait_for(
            lambda: any(r["out_dir"].endswith("maps-f") for r in status(endpoint, 2)["runs"]),
            30,
            "bob's forged run",
        )
        mine = as_user(bob, train, endpoint, "maps-b", "42")
        assert mine["monitored"] and mine["out_dir"] == str(root / bob / "maps-b")
        view = status(endpoint, 5)
        assert view["job_ids_dropped"] == 2
        assert {r["out_dir"].rsplit("/", 1)[1]: r["job_id"] for r in view["runs"]} == {
            "maps-a": "41",
            "maps-f": None,
            "maps-b": None,
        }
        epilog_666 = subprocess.run(
            sidecar_command("finish", "--job", "666", "--endpoint", endpoint),
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "job 666: 0 runs ended" in epilog_666.stdout, epilog_666.stderr
        for out_dir in (str(theirs / "stolen"), f"../{alice}/stolen"):
            refused = as_user(bob, train, endpoint, out_dir, "42")
            assert not refused["monitored"]
            assert any(f"another user's folder ({alice})" in w for w in refused["warnings"])
        assert not (theirs / "stolen").exists()
        assert as_user(bob, try_files, str(theirs)) == {"list": "denied", "write": "denied"}
        assert as_user(bob, runs_seen, endpoint) == {"users": [bob], "error": None}
        # the Slurm epilog (root) ends job 41; `status --job` shows that job only
        finished = subprocess.run(
            sidecar_command("finish", "--job", "41", "--endpoint", endpoint),
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert finished.returncode == 0, finished.stderr
        assert "job 41: 1 runs ended" in finished.stdout
        view = json.loads(status_text(endpoint, "--job", "41", "--json"))
        assert [(r["user"], r["status"]) for r in view["runs"]] == [(alice, "incomplete")]
    finally:
        stop_file.touch()
        if long_job is not None:
            long_job.wait(60)
        if forged is not None:
            os.waitpid(forged, 0)
        daemon.terminate()
        daemon.wait(20)
    for user, out_dir in ((alice, "maps-a"), (bob, "maps-b"), (bob, "maps-f")):
        folder = root / user
        assert folder.stat().st_mode & 0o777 == 0o700
        assert _owners(folder) == {uid[user]}  # every folder and file is the user's
        meta = run_json(folder / out_dir)
        assert meta["user"] == user  # the kernel's word, not getpass's "root"
    assert run_json(root / alice / "maps-a")["cause"] == "Slurm job 41 ended"
    assert run_json(root / bob / "maps-b")["status"] == "completed"
    forged_run = run_json(root / bob / "maps-f")
    assert (forged_run["status"], forged_run["job_id"]) == ("completed", None)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted(users)


def test_a_daemon_that_is_not_shared_refuses_other_users(
    users: tuple[str, str], short_tmp: Path
) -> None:
    short_tmp.chmod(0o755)
    (short_tmp / "root").mkdir()
    endpoint = f"ipc://{short_tmp}/s.sock"
    daemon = _daemon(short_tmp)
    try:
        wait_for(lambda: status(endpoint, 0.5), 30, "the daemon to answer")
        (short_tmp / "s.sock").chmod(0o666)  # left open by mistake: the kernel still says who
        refused = as_user(users[1], train, endpoint, "maps", "7")
        assert not refused["monitored"]
        assert any(
            f"user {users[1]} may not use the sidecar of root" in w for w in refused["warnings"]
        )
        view = status(endpoint, 5)
        assert view["rejected_by_kind"].get("foreign_user", 0) >= 1 and view["runs"] == []
    finally:
        daemon.terminate()
        daemon.wait(20)
    assert list((short_tmp / "root").iterdir()) == []


def test_shared_needs_root_and_ipc(short_tmp: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--shared",
            "--root",
            str(short_tmp),
            "--endpoint",
            "tcp://:5999",
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "needs an ipc:// --endpoint" in result.stderr
