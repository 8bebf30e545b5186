"""A shared node daemon serving real local users whose Python cannot read the daemon's
installation (docs/node-daemon.md): what each user's run gets written, and what a
neighbour cannot do. Needs root, useradd and Debian's python3 with python3-zmq.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import local_users
from tests.support.helpers import Sidecar, run_json, split_dir, wait_for
from tests.support.own_sidecar import free_port
from tests.support.shared_node import prepare, start_shared, user_job

WHY_NOT = local_users.unavailable() or local_users.user_python_unavailable()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=str(WHY_NOT))


def test_a_run_finished_on_a_shared_daemon_is_written(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    """The final write of a run that never checkpointed comes from its finish(), while
    the daemon handles that user's message: it must not need to import anything as
    that user."""
    site = prepare(short_tmp)
    daemon = start_shared(serve)
    with local_users.local_users(1, tag="w") as (user,):
        job = user_job(
            user, site, daemon.endpoint, short_tmp, "user_job", "--epochs", "0", "--out-dir", "maps"
        )
        _out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        meta = run_json(daemon.root / user / "maps")
        assert meta.get("status") == "completed", (err, daemon.log.read_text()[-2000:])
        assert (split_dir(daemon.root / user / "maps") / "summary.log").exists()
        assert "internal_error" not in daemon.status()["rejected_by_kind"]


def _run_of(daemon: Sidecar, out_dir: str) -> dict[str, Any] | None:
    """The status view's run whose folder ends in ``out_dir`` (as root: every run)."""
    return next((r for r in daemon.status()["runs"] if r["out_dir"].endswith(out_dir)), None)


def _resume(*pids: int) -> None:
    """SIGCONT to each of ``pids``: the job, and runuser above it, which stops itself
    when its child is stopped (as su does)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_neighbour_cannot_take_a_run_over_after_a_restart(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    """bob names alice's run id in a hello to the daemon started after a crash, before
    alice's own hello came back: refused, counted, nothing changes; alice's run goes on
    in her folder and is written whole."""
    site = prepare(short_tmp)
    stop_file = short_tmp / "stop"
    first = start_shared(serve)
    with local_users.local_users(2, tag="o") as (alice, bob):
        job = user_job(
            alice,
            site,
            first.endpoint,
            short_tmp,
            "loop_job",
            "--out-dir",
            "maps-a",
            "--stop-file",
            str(stop_file),
            "--sleep",
            "0.01",
            "--iters",
            "10",
            "--warmup",
            "0",
        )
        try:
            run = wait_for(lambda: _run_of(first, "maps-a"), 60, "alice's run")
            os.kill(run["pid"], signal.SIGSTOP)  # her next hello comes after bob's
            first.process.kill()
            first.process.wait(30)
            second = start_shared(serve)
            claim = subprocess.run(
                [
                    "runuser",
                    "-u",
                    bob,
                    "--",
                    local_users.SYSTEM_PYTHON,
                    "-m",
                    "jobs.claim_run",
                    second.endpoint,
                    run["run_id"],
                ],
                cwd=short_tmp,
                capture_output=True,
                text=True,
                timeout=60,
                env={"PATH": os.environ["PATH"], "PYTHONPATH": str(site)},
            )
            reply = json.loads(claim.stdout or "null")
            assert reply is not None and not reply["ok"], (reply, claim.stderr)
            assert f"belongs to {alice}" in reply["error"]
            assert second.status()["rejected_by_kind"].get("foreign_user") == 1
            assert _run_of(second, "stolen") is None
            _resume(run["pid"], job.pid)
            wait_for(
                lambda: (_run_of(second, "maps-a") or {}).get("records"),
                60,
                "alice's run to come back",
            )
        finally:
            stop_file.touch()
            with contextlib.suppress(NameError):
                _resume(run["pid"], job.pid)
            _out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        assert "refused" not in err and "did not write" not in err, err
        meta = run_json(second.root / alice / "maps-a")
        assert meta.get("status") == "completed", second.log.read_text()[-3000:]
        assert not (second.root / bob).exists()


RUNNING_2 = 'trainmon_runs{status="running"} 2.0'


def _scrape(port: int, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


def _scrape_with(port: int, text: str) -> str | None:
    """A plain scrape, when it holds ``text``."""
    scraped = _scrape(port)
    return scraped if text in scraped else None


def test_metrics_show_each_viewer_what_is_theirs(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    """A plain scrape (any local user's curl) sees the node-wide figures only; a user's
    token, their own runs; the admin's token, every run."""
    site = prepare(short_tmp)
    admin_file = short_tmp / "admin-token"
    admin_file.write_text("s3cret-of-the-admin\n")
    admin_file.chmod(0o600)
    port = free_port()
    daemon = start_shared(
        serve, "--metrics-port", str(port), "--metrics-token-file", str(admin_file)
    )
    stop_file = short_tmp / "stop"
    with local_users.local_users(2, tag="m") as (alice, bob):
        jobs = [
            user_job(
                user,
                site,
                daemon.endpoint,
                short_tmp,
                "loop_job",
                "--out-dir",
                f"maps-{user}",
                "--stop-file",
                str(stop_file),
                "--sleep",
                "0.01",
            )
            for user in (alice, bob)
        ]
        try:
            runs = wait_for(lambda: len(r := daemon.status()["runs"]) == 2 and r, 60, "both runs")
            ids = {run["user"]: run["run_id"] for run in runs}
            # the exporter's snapshot is the loop's latest, taken at most 0.2 s ago
            plain = wait_for(
                lambda: _scrape_with(port, RUNNING_2), 30, "both runs counted in /metrics"
            )
            assert not any(ids[u] in plain or u in plain for u in ids), plain
            token_file = daemon.root / bob / ".metrics-token"
            info = token_file.stat()
            assert (info.st_uid, info.st_mode & 0o777) == (pwd.getpwnam(bob).pw_uid, 0o600)
            own = _scrape(port, token_file.read_text().strip())
            assert ids[bob] in own and ids[alice] not in own and alice not in own
            assert "trainmon_phase_duration_seconds" in own
            everything = _scrape(port, "s3cret-of-the-admin")
            assert ids[bob] in everything and ids[alice] in everything
            assert ids[alice] not in _scrape(port, "a guess")
        finally:
            stop_file.touch()
            for job in jobs:
                job.communicate(timeout=120)


def _own_folder(home: Path, user: str) -> Path:
    """``home/<user>``, 0700 and the user's, as a home or scratch folder is."""
    folder = home / user
    folder.mkdir(mode=0o700)
    account = pwd.getpwnam(user)
    os.chown(folder, account.pw_uid, account.pw_gid)
    return folder


def test_a_run_goes_into_the_users_own_folder_under_an_allowed_root(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    """``--allow HOME``: alice's run is written where her job says, as her; bob cannot
    name her folder, nor lead a link out of the allowed root; a job elsewhere is told
    that its run goes under the daemon's root."""
    site = prepare(short_tmp)
    home = short_tmp / "home"
    home.mkdir(mode=0o755)
    daemon = start_shared(serve, "--allow", str(home))
    quick = ("--epochs", "1", "--iters", "5", "--warmup", "0")
    with local_users.local_users(2, tag="h") as (alice, bob):
        mine, theirs = _own_folder(home, alice), _own_folder(home, bob)
        (theirs / "link").symlink_to("/etc")
        outcomes = {}
        for name, user, cwd, out_dir in (
            ("in place", alice, mine, "maps"),
            ("her folder", bob, theirs, str(mine / "stolen")),
            ("a link out", bob, theirs, "link/trainmon-test"),
            ("elsewhere", bob, short_tmp, "maps-e"),
        ):
            job = user_job(
                user, site, daemon.endpoint, cwd, "loop_job", "--out-dir", out_dir, *quick
            )
            _out, err = job.communicate(timeout=120)
            assert job.returncode == 0, err
            outcomes[name] = err
        uid = pwd.getpwnam(alice).pw_uid
        assert run_json(mine / "maps").get("status") == "completed", outcomes["in place"]
        assert {p.lstat().st_uid for p in (mine / "maps").rglob("*")} == {uid}
        assert not (daemon.root / alice / "maps").exists()
        assert "is written in" not in outcomes["in place"]
        assert "refused this run" in outcomes["her folder"], outcomes["her folder"]
        assert not (mine / "stolen").exists()
        assert not Path("/etc/trainmon-test").exists()
        for name, folder in (("a link out", "link/trainmon-test"), ("elsewhere", "maps-e")):
            assert f"is written in {daemon.root / bob / folder}" in outcomes[name], outcomes[name]
            assert run_json(daemon.root / bob / folder).get("status") == "completed"
