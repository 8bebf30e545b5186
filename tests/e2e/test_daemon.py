"""The node daemon's core and the endpoint security rules:
``sidecar serve --root``, ``sidecar status``, refusals outside the root, private ipc
sockets, tcp on loopback.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import psutil
import pytest

import markers
from tests.support.helpers import env, run_json, split_dir, start_job, status_text, wait_for


def test_status_json_is_one_object_with_the_contract_keys(serve, short_tmp: Path) -> None:
    sidecar = serve()
    job = start_job(sidecar.endpoint, short_tmp, "--out-dir", "job1", "--epochs", "1")
    assert job.wait(60) == 0
    out = status_text(sidecar.endpoint, "--json")
    view = json.loads(out)  # one object, nothing else on stdout
    assert isinstance(view["runs"], list) and len(view["runs"]) == 1
    assert view["records"] > 0 and view["dropped"] == 0 and view["rejected"] == 0
    assert view["runs"][0]["status"] == "completed"
    assert view["records_per_s"] >= 0
    assert view["samplers"]["host"] == "on" and view["samplers"]["gpu"].startswith(("on", "off ("))
    # a relative out_dir lands under the root, whatever the job's cwd
    assert run_json(short_tmp / "root" / "job1")["status"] == "completed"
    assert not (short_tmp / "job1").exists()
    text = status_text(sidecar.endpoint)
    assert "records" in text and "job1" in text and "sampling every 1 s: host on" in text


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_out_dir_outside_the_root_is_refused_and_nothing_is_written(
    serve, short_tmp: Path, where: str
) -> None:
    outside = short_tmp / "outside"
    outside.mkdir()
    root = short_tmp / "root"
    root.mkdir(exist_ok=True)
    (root / "link").symlink_to(outside)
    out_dir = {
        "dotdot": "sub/../../outside/run",
        "absolute": str(outside / "run"),
        "symlink": "link/run",
    }[where]
    sidecar = serve(root=root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = markers.start_run(out_dir=out_dir, endpoint=sidecar.endpoint)
    assert not run.monitored
    assert any("outside the daemon's root" in str(w.message) for w in caught)
    run.finish()
    view = sidecar.status()
    assert view["rejected_by_kind"].get("refused") == 1
    assert "outside the daemon's root" in view["last_error"]
    assert list(outside.iterdir()) == []
    assert [p.name for p in root.iterdir()] == ["link"]


def test_unknown_batch_size_says_so_and_never_crashes(serve, short_tmp: Path) -> None:
    sidecar = serve()
    job = start_job(
        sidecar.endpoint, short_tmp, "--out-dir", "nobs", "--epochs", "1", "--unknown-batch-size"
    )
    assert job.wait(60) == 0
    summary = (split_dir(short_tmp / "root" / "nobs") / "summary.log").read_text()
    assert summary.count("Throughput: unknown (batch size not given and not readable") == 2
    assert run_json(short_tmp / "root" / "nobs")["status"] == "completed"


def test_ipc_socket_is_private_under_xdg_runtime_dir(short_tmp: Path) -> None:
    runtime = short_tmp / "xdg"
    runtime.mkdir()
    (runtime / "sidecar").mkdir(mode=0o755)  # left loose by someone: tightened
    os.chmod(runtime / "sidecar", 0o755)
    (short_tmp / "root").mkdir()
    log = (short_tmp / "log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--root", str(short_tmp / "root")],
        env=env(XDG_RUNTIME_DIR=str(runtime)),
        stdout=log,
        stderr=log,
    )
    sock = runtime / "sidecar" / "sidecar.sock"
    try:
        wait_for(sock.exists, 30, "the daemon's default socket under XDG_RUNTIME_DIR")
        assert stat.S_IMODE((runtime / "sidecar").stat().st_mode) == 0o700
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        view = subprocess.run(
            [sys.executable, "-m", "sidecar", "status", "--json"],
            env=env(XDG_RUNTIME_DIR=str(runtime)),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert json.loads(view)["endpoint"] == f"ipc://{sock}"
    finally:
        process.terminate()
        process.wait(10)


def test_private_sidecar_folder_is_0700(short_tmp: Path) -> None:
    from markers.endpoints import private_endpoint

    old = os.umask(0o022)
    try:
        endpoint = private_endpoint()
    finally:
        os.umask(old)
    folder = Path(endpoint.removeprefix("ipc://")).parent
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    finally:
        folder.rmdir()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_tcp_without_host_binds_to_loopback_only(serve) -> None:
    port = _free_port()
    sidecar = serve(endpoint=f"tcp://:{port}")
    assert sidecar.status()["endpoint"] == f"tcp://127.0.0.1:{port}"
    listening = [
        c.laddr
        for c in psutil.Process(sidecar.process.pid).net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening)
