"""A shared node daemon serving real local users whose Python cannot read the daemon's
installation (docs/node-daemon.md): what each user's run gets written, and what a
neighbour cannot do. Needs root, useradd and Debian's python3 with python3-zmq.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import local_users
from tests.support.helpers import Sidecar, run_json, split_dir, wait_for
from tests.support.shared_node import prepare, start_shared, user_job

WHY_NOT = local_users.unavailable() or local_users.user_python_unavailable()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=str(WHY_NOT))


def test_a_run_finished_on_a_shared_daemon_is_written(serve: Callable[..., Sidecar],
                                                      short_tmp: Path) -> None:
    """The final write of a run that never checkpointed comes from its finish(), while
    the daemon handles that user's message: it must not need to import anything as
    that user."""
    site = prepare(short_tmp)
    daemon = start_shared(serve)
    with local_users.local_users(1, tag="w") as (user,):
        job = user_job(user, site, daemon.endpoint, short_tmp, "user_job", "--epochs", "0",
                       "--out-dir", "maps")
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


def test_a_neighbour_cannot_take_a_run_over_after_a_restart(serve: Callable[..., Sidecar],
                                                           short_tmp: Path) -> None:
    """bob names alice's run id in a hello to the daemon started after a crash, before
    alice's own hello came back: refused, counted, nothing changes; alice's run goes on
    in her folder and is written whole."""
    site = prepare(short_tmp)
    stop_file = short_tmp / "stop"
    first = start_shared(serve)
    with local_users.local_users(2, tag="o") as (alice, bob):
        job = user_job(alice, site, first.endpoint, short_tmp, "loop_job", "--out-dir",
                       "maps-a", "--stop-file", str(stop_file), "--sleep", "0.01",
                       "--iters", "10", "--warmup", "0")
        try:
            run = wait_for(lambda: _run_of(first, "maps-a"), 60, "alice's run")
            os.kill(run["pid"], signal.SIGSTOP)  # her next hello comes after bob's
            first.process.kill()
            first.process.wait(30)
            second = start_shared(serve)
            claim = subprocess.run(
                ["runuser", "-u", bob, "--", local_users.SYSTEM_PYTHON, "-m", "jobs.claim_run",
                 second.endpoint, run["run_id"]], cwd=short_tmp, capture_output=True,
                text=True, timeout=60, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(site)})
            reply = json.loads(claim.stdout or "null")
            assert reply is not None and not reply["ok"], (reply, claim.stderr)
            assert f"belongs to {alice}" in reply["error"]
            assert second.status()["rejected_by_kind"].get("foreign_user") == 1
            assert _run_of(second, "stolen") is None
            _resume(run["pid"], job.pid)
            wait_for(lambda: (_run_of(second, "maps-a") or {}).get("records"), 60,
                     "alice's run to come back")
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
