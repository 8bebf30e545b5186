"""The repository's Slurm TaskProlog (systemd/slurm/task_prolog.sh), run by ``sh`` as Slurm
runs it, over a folder of real unix sockets standing for a node's /run: what it prints is
what the task's environment becomes (``export`` and ``unset`` lines).

Under ``srun`` in a batch job, every task inherits the environment the batch script got
from this script on the job's first node; on another node that endpoint may name a sidecar
that does not run there.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.helpers import REPO

PROLOG = REPO / "systemd" / "slurm" / "task_prolog.sh"
USER = "alice"


@pytest.fixture
def node_run(tmp_path: Path) -> Iterator[Path]:
    """A node's /run with the node daemon's socket listening (sidecar/sidecar.sock)."""
    (tmp_path / "sidecar").mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(tmp_path / "sidecar" / "sidecar.sock"))
        yield tmp_path


def _prolog(run: Path, **environment: str) -> list[str]:
    """The lines the TaskProlog prints for a task of USER with ``environment``."""
    done = subprocess.run(
        ["sh", str(PROLOG)],
        env={
            "PATH": os.environ["PATH"],
            "SLURM_JOB_USER": USER,
            "SIDECAR_SOCKET_ROOT": str(run),
            **environment,
        },
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert done.stderr == ""
    return done.stdout.splitlines()


def test_a_task_is_pointed_at_its_nodes_daemon(node_run: Path) -> None:
    endpoint = f"ipc://{node_run}/sidecar/sidecar.sock"
    assert _prolog(node_run) == [
        f"export SIDECAR_ENDPOINT={endpoint}",
        f"export SIDECAR_PROLOG_ENDPOINT={endpoint}",
    ]


def test_an_endpoint_the_job_set_itself_is_kept(node_run: Path) -> None:
    assert _prolog(node_run, SIDECAR_ENDPOINT="ipc:///home/alice/mine.sock") == []


def test_an_endpoint_chosen_on_the_first_node_is_chosen_again_on_this_one(
    node_run: Path,
) -> None:
    # the first node ran the user's own instance; this node runs only the node daemon
    elsewhere = f"ipc://{node_run}/sidecar-{USER}/sidecar.sock"
    here = f"ipc://{node_run}/sidecar/sidecar.sock"
    inherited = {"SIDECAR_ENDPOINT": elsewhere, "SIDECAR_PROLOG_ENDPOINT": elsewhere}
    assert _prolog(node_run, **inherited) == [
        f"export SIDECAR_ENDPOINT={here}",
        f"export SIDECAR_PROLOG_ENDPOINT={here}",
    ]


def test_a_node_without_a_sidecar_drops_the_endpoint_of_another(tmp_path: Path) -> None:
    elsewhere = f"ipc://{tmp_path}/sidecar/sidecar.sock"
    inherited = {"SIDECAR_ENDPOINT": elsewhere, "SIDECAR_PROLOG_ENDPOINT": elsewhere}
    assert _prolog(tmp_path, **inherited) == ["unset SIDECAR_ENDPOINT"]
    assert _prolog(tmp_path) == []
