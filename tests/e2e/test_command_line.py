"""Command-line mistakes and endpoints already taken (docs/contract.md, Faults and bad input):
one line that says what and how to fix it, exit status 2, no traceback, and the job never
started behind the user's back; a second sidecar never steals a served socket, a stale
socket file is taken over; ``sidecar status`` on a missing socket answers at once.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import env, sidecar_command

RAN = "import pathlib; pathlib.Path('ran').touch()"


def _sidecar(*args: str, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        sidecar_command(*args),
        cwd=cwd,
        env=env(XDG_RUNTIME_DIR=str(cwd)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _one_line_exit_2(result: subprocess.CompletedProcess, *words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["run", "--endpoint", "udp://127.0.0.1:5555"],
            ["unknown endpoint scheme 'udp'", "tcp://HOST:PORT"],
        ),
        (["run", "--endpoint", "127.0.0.1:5555"], ["no endpoint scheme", "ipc://"]),
        (["run", "--endpoint", "tcp://127.0.0.1"], ["needs a port"]),
        (["run", "--endpoint", "ipc://" + "x" * 200], ["shorter path"]),
        (["run", "--interval", "nan"], ["nan is not a finite number"]),
        (["run", "--interval", "inf"], ["inf is not a finite number"]),
        (["run", "--heartbeat", "nan"], ["not a finite number"]),
        (["run", "--interval", "fast"], ["'fast' is not a number"]),
    ],
)
def test_a_command_line_mistake_is_one_line_exit_2_and_the_job_never_runs(
    short_tmp: Path, args: list[str], words: list[str]
) -> None:
    result = _sidecar(*args, "--", sys.executable, "-c", RAN, cwd=short_tmp)
    _one_line_exit_2(result, *words)
    assert not (short_tmp / "ran").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--root", ".", "--endpoint", "udp://x"],
        ["serve", "--root", ".", "--interval", "-inf"],
        ["status", "--endpoint", "http://localhost:80"],
        ["serve"],  # no --root
    ],
)
def test_serve_and_status_mistakes_are_one_line_exit_2(short_tmp: Path, args: list[str]) -> None:
    _one_line_exit_2(_sidecar(*args, cwd=short_tmp))


def test_a_tcp_port_in_use_is_one_line_exit_2_and_the_job_never_runs(short_tmp: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _sidecar(
            "run",
            "--endpoint",
            f"tcp://127.0.0.1:{port}",
            "--",
            sys.executable,
            "-c",
            RAN,
            cwd=short_tmp,
        )
    _one_line_exit_2(result, "already in use", "choose another port")
    assert not (short_tmp / "ran").exists()


def test_a_second_sidecar_on_a_served_endpoint_refuses(serve, short_tmp: Path) -> None:
    first = serve()
    result = _sidecar(
        "serve", "--root", str(short_tmp), "--endpoint", first.endpoint, cwd=short_tmp
    )
    _one_line_exit_2(result, "already served by another sidecar")
    assert first.status()["pid"] == first.process.pid  # the first still has its socket
    result = _sidecar(
        "run", "--endpoint", first.endpoint, "--", sys.executable, "-c", RAN, cwd=short_tmp
    )
    _one_line_exit_2(result, "already served")
    assert not (short_tmp / "ran").exists()
    assert first.status()["pid"] == first.process.pid


def test_a_stale_socket_file_is_taken_over(serve, short_tmp: Path) -> None:
    path = short_tmp / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # bound, then closed: nobody behind it
        dead.bind(str(path))
    assert path.is_socket()
    sidecar = serve(endpoint=f"ipc://{path}")
    assert sidecar.status()["pid"] == sidecar.process.pid
    assert "took over the stale socket file" in sidecar.log.read_text()


def test_a_file_that_is_not_a_socket_is_left_alone(short_tmp: Path) -> None:
    path = short_tmp / "notes.txt"
    path.write_text("mine")
    result = _sidecar(
        "serve", "--root", str(short_tmp), "--endpoint", f"ipc://{path}", cwd=short_tmp
    )
    _one_line_exit_2(result, "is not a socket")
    assert path.read_text() == "mine"


def test_status_without_a_socket_file_answers_at_once(short_tmp: Path) -> None:
    started = time.monotonic()
    result = _sidecar("status", "--endpoint", f"ipc://{short_tmp}/none.sock", cwd=short_tmp)
    elapsed = time.monotonic() - started
    print(f"sidecar status on a missing socket: {elapsed:.2f} s")
    assert result.returncode == 1
    assert "socket file does not exist" in result.stderr
    assert elapsed < 3.0  # an interpreter's start; the status wait is 5 s


def test_serve_help_mentions_no_hidden_option(short_tmp: Path) -> None:
    result = _sidecar("serve", "--help", cwd=short_tmp)
    assert result.returncode == 0
    assert "owner" not in result.stdout.lower()
    assert "--root" in result.stdout and "--heartbeat" in result.stdout
