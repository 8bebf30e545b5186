"""A job's own sidecar serves only its job (docs/contract.md, Faults and bad input "a forged or
foreign client"): ``sidecar run`` hands the job a secret in SIDECAR_SECRET, its socket is a CURVE
server that lets in only holders of the secret; any other client fails the handshake, is
counted, and nothing it sends is read, let alone written. Run folders at absurd places
(``/////``, ``/tmp``) are refused too; a refused run stops sending.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq

from markers import secret as shared_secret
from tests.support.frames import Client
from tests.support.helpers import (
    JOB,
    SAME_PRIORITY,
    env,
    job_args,
    progress,
    run_json,
    sidecar_command,
    start_job,
    status,
    wait_for,
)
from tests.support.own_sidecar import free_port, job_secret, run_job


def _forger(endpoint: str, curve_server_key: bytes | None = None) -> zmq.Socket:
    """A DEALER that sends a hello for someone else's folder and records: plain ZeroMQ, or
    CURVE with the right server key but a key pair of its own."""
    forger = zmq.Context.instance().socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    if curve_server_key is not None:
        forger.curve_serverkey = curve_server_key
        forger.curve_publickey, forger.curve_secretkey = zmq.curve_keypair()
    forger.connect(endpoint)
    return forger


def test_a_jobs_own_sidecar_serves_only_its_job(short_tmp: Path) -> None:
    victim = short_tmp / "victim"
    victim.mkdir()
    (victim / "run.json").write_text("theirs")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    stop = short_tmp / "stop"
    sidecar = run_job(short_tmp, endpoint, stop)
    try:
        job = wait_for(
            lambda: progress(short_tmp / "p.json").get("epochs"), 60, "the job to train"
        ) and progress(short_tmp / "p.json")
        secret = job_secret(job["pid"])
        forgers = [_forger(endpoint), _forger(endpoint, shared_secret.keys(secret, "server")[0])]
        for forger in forgers:
            intruder = Client()
            forger.send(intruder.hello(str(victim)))
            forger.send(intruder.records(10))
        view = wait_for(
            lambda: (
                (v := status(endpoint, 2.0, secret))
                and v["rejected_by_kind"].get("unauthenticated", 0) >= 1
                and v
            ),
            30,
            "the forgers to be refused and counted",
        )
        # refused at the same time, retried by ZeroMQ all along: one spell, counted once
        assert view["rejected_by_kind"] == {"unauthenticated": 1}, view["rejected_by_kind"]
        assert [run["out_dir"] for run in view["runs"]] == [str(short_tmp / "maps")]
        assert not any(forger.poll(0) for forger in forgers)  # never answered
        assert status(endpoint, 1.0) is None  # no status without the secret either
        for forger in forgers:
            forger.close()
        stop.touch()
        assert sidecar.wait(60) == 0
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
    assert (victim / "run.json").read_text() == "theirs"
    assert sorted(p.name for p in victim.iterdir()) == ["run.json"]
    assert run_json(short_tmp / "maps")["status"] == "completed"


@pytest.mark.parametrize("out_dir", ["/////", "/", "/tmp"])
def test_a_run_folder_at_an_absurd_place_is_refused(short_tmp: Path, out_dir: str) -> None:
    existed = {p: p.exists() for p in (Path("/run.json"), Path("/training"), Path("/tmp/run.json"))}
    result = subprocess.run(
        sidecar_command(
            "run", "--quiet", "--", sys.executable, str(JOB), "--out-dir", out_dir, "--epochs", "1"
        ),
        cwd=short_tmp,
        env=env(XDG_RUNTIME_DIR=str(short_tmp)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr  # training went on
    warned = [line for line in result.stderr.splitlines() if "markers:" in line]
    assert len(warned) == 1, result.stderr
    assert "refused this run" in warned[0]
    assert "filesystem root or a folder right under it" in warned[0]
    assert {p: p.exists() for p in existed} == existed


def test_a_refused_run_says_so_and_stops_sending(serve, short_tmp: Path) -> None:
    sidecar = serve()
    elsewhere = short_tmp / "elsewhere"
    job = start_job(
        sidecar.endpoint,
        short_tmp,
        "--out-dir",
        str(elsewhere),
        "--epochs",
        "1",
        "--iters",
        "300",
        "--sleep",
        "0.01",
        stderr=subprocess.PIPE,
    )
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 0
    warned = [line for line in stderr.decode().splitlines() if "markers:" in line]
    assert len(warned) == 1, stderr
    assert "refused this run" in warned[0] and "outside the daemon's root" in warned[0]
    assert "not reachable" not in warned[0]
    assert sidecar.status()["rejected_by_kind"] == {"refused": 1}  # no flood of unknown_run
    assert not elsewhere.exists()


def test_waiting_for_a_sidecar_without_the_cpu_leaves_no_reject_behind(
    serve, short_tmp: Path
) -> None:
    """A sidecar that gets no CPU while it starts (frozen here right after it binds, as a
    loaded machine does by chance) counts nothing from the clients that wait for it: the
    fixture's one client waits through it, none hangs up in the middle of its handshake
    (which the sidecar would count as a ``handshake`` reject, and the exact reject counts
    asserted above would go one too high)."""
    sock = short_tmp / "s.sock"
    frozen_s = 2.0  # longer than a status request's default timeout

    def freeze_once_bound() -> None:
        wait_for(sock.exists, 30, "the sidecar to bind", interval_s=0.005)
        (pid,) = [child.pid for child in psutil.Process().children() if "serve" in child.cmdline()]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(frozen_s)
        finally:
            os.kill(pid, signal.SIGCONT)

    freezer = threading.Thread(target=freeze_once_bound)
    freezer.start()
    sidecar = serve()
    freezer.join()
    assert sidecar.status()["rejected_by_kind"] == {}


def test_status_of_a_jobs_own_sidecar_from_another_terminal_of_its_user(short_tmp: Path) -> None:
    stop = short_tmp / "stop"
    sidecar = subprocess.Popen(
        # at the job's priority: at +10 on a loaded machine it answers after the 5 s of
        # `sidecar status` (tests/e2e/test_priority.py checks the default)
        sidecar_command(
            "run",
            "--quiet",
            *SAME_PRIORITY,
            "--",
            sys.executable,
            str(JOB),
            *job_args(out_dir="maps", stop_file=stop, progress=short_tmp / "p.json"),
        ),
        cwd=short_tmp,
        env=env(XDG_RUNTIME_DIR=str(short_tmp)),
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: progress(short_tmp / "p.json").get("epochs"), 60, "the job to train")
        (folder,) = (short_tmp / "sidecar").glob("job-*")
        kept = folder / "sidecar.sock.secret"
        assert kept.stat().st_mode & 0o777 == 0o600
        result = subprocess.run(  # no SIDECAR_SECRET here: the one beside the socket is used
            sidecar_command("status", "--json", "--endpoint", f"ipc://{folder}/sidecar.sock"),
            env=env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["runs"][0]["out_dir"] == str(short_tmp / "maps")
        stop.touch()
        assert sidecar.wait(60) == 0
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
    assert not folder.exists()  # socket, secret and folder gone
