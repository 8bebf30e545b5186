"""A shared node daemon serving real local users whose Python cannot read the daemon's
installation (docs/node-daemon.md): what each user's run gets written, and what a
neighbour cannot do. Needs root, useradd and Debian's python3 with python3-zmq.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import local_users
from tests.support.helpers import Sidecar, run_json, split_dir
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
