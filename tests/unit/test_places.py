"""Endpoints a sidecar can serve (``markers.endpoints.check``) and run folders at absurd
places (``sidecar.daemon.policy``): what is accepted, what is refused and what the
message says.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from markers.endpoints import check
from sidecar.daemon.policy import OutDirPolicy
from sidecar.ingest.hello_check import Refused


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///run/s.sock",
        "tcp://127.0.0.1:5555",
        "tcp://:5555",
        "tcp://*:5555",
        "tcp://[::1]:80",
        "tcp://127.0.0.1:*",
    ],
)
def test_endpoints_that_can_be_served(endpoint: str) -> None:
    assert check(endpoint) == endpoint


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("udp://127.0.0.1:5555", "unknown endpoint scheme 'udp'"),
        ("127.0.0.1:5555", "no endpoint scheme"),
        ("tcp://127.0.0.1", "needs a port"),
        ("tcp://127.0.0.1:0", "needs a port"),
        ("tcp://127.0.0.1:70000", "needs a port"),
        ("ipc://", "1 to 107 bytes"),
        ("ipc:///" + "x" * 120, "shorter path"),
    ],
)
def test_endpoints_refused_with_what_to_give(endpoint: str, says: str) -> None:
    with pytest.raises(ValueError) as raised:
        check(endpoint)
    assert says in str(raised.value)


@pytest.mark.parametrize("out_dir", ["/", "/////", "/tmp", "/home", "/..", "/tmp/.."])
def test_a_jobs_own_sidecar_refuses_absurd_places(out_dir: str) -> None:
    with pytest.raises(Refused, match="filesystem root or a folder right under it"):
        OutDirPolicy(None).resolve(out_dir, "/work")


def test_the_home_folder_itself_and_the_daemons_root_itself_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(Refused, match="the home folder itself"):
        OutDirPolicy(None).resolve("..", str(tmp_path / "home" / "project"))
    with pytest.raises(Refused, match="the daemon's root itself"):
        OutDirPolicy(tmp_path).resolve(".", "/")
    with pytest.raises(Refused, match="cannot be resolved"):
        OutDirPolicy(None).resolve("a\0b", "/work")


def test_ordinary_places_are_kept(tmp_path: Path) -> None:
    assert OutDirPolicy(None).resolve("maps", str(tmp_path)) == tmp_path / "maps"
    assert OutDirPolicy(None).resolve("/tmp/x/maps", "/") == Path("/tmp/x/maps")
    assert OutDirPolicy(tmp_path).resolve("maps", "/") == tmp_path.resolve() / "maps"
