"""Where a shared node daemon places a user's runs (``sidecar.daemon.policy``): inside the
user's own folder only, whatever the path says (relative, absolute, '..', a symlink into
another user's folder); a refusal names the other user's folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.daemon.policy import OutDirPolicy
from sidecar.ingest.hello_check import Refused
from sidecar.ingest.peers import Peer

ALICE, BOB = Peer(4001, 4001, 1), Peer(4002, 4002, 1)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for user in (ALICE, BOB):
        (tmp_path / user.name).mkdir()
    (tmp_path / ALICE.name / "to-bob").symlink_to(tmp_path / BOB.name)
    return tmp_path


def test_a_users_runs_go_under_their_folder(root: Path) -> None:
    policy = OutDirPolicy(root, shared=True)
    mine = root / ALICE.name
    assert policy.resolve("maps", "/anywhere", ALICE) == mine / "maps"
    assert policy.resolve(str(mine / "x"), "/", ALICE) == mine / "x"
    assert policy.refusal(mine / "maps", ALICE) is None


@pytest.mark.parametrize("out_dir", ["../{bob}/run", "{root}/{bob}/run", "to-bob/run"])
def test_another_users_folder_is_refused_by_name(root: Path, out_dir: str) -> None:
    policy = OutDirPolicy(root, shared=True)
    with pytest.raises(
        Refused,
        match=rf"lies in another user's folder \({BOB.name}\); the "
        rf"runs of {ALICE.name} go under",
    ):
        policy.resolve(out_dir.format(root=root, bob=BOB.name), "/", ALICE)
    assert policy.refusal(root / ALICE.name / "to-bob" / "run", ALICE) is not None


def test_outside_the_root_and_unknown_users_are_refused(root: Path) -> None:
    policy = OutDirPolicy(root, shared=True)
    with pytest.raises(Refused, match="outside the daemon's root"):
        policy.resolve("/etc/run", "/", ALICE)
    with pytest.raises(Refused, match="serves only ipc clients"):
        policy.resolve("maps", "/", None)
    # a daemon that is not shared keeps one folder for every run
    assert OutDirPolicy(root).resolve(f"{BOB.name}/run", "/", ALICE) == root / BOB.name / "run"
