"""The units in systemd/ (docs/contract.md, Node daemon): through the real ``systemd-analyze``,
``verify`` prints nothing (it warns with exit status 0, so the text is checked) and the hardening
keeps the exposure score recorded in docs/node-daemon.md; and each unit's ExecStart line, with
its specifiers and the options file expanded as systemd would, starts a daemon that
says READY=1 on a real notify socket and serves (verify does not check our options).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import REPO, env, status
from tests.support.notify_socket import Manager
from tests.support.tools import require_tool

UNITS = REPO / "systemd"
# The scores of `systemd-analyze security --offline=true` recorded in docs/node-daemon.md.
RECORDED_EXPOSURE = {"sidecar.service": 2.6, "sidecar@.service": 1.7}

needs_analyze = pytest.mark.usefixtures("systemd_analyze")


@pytest.fixture
def systemd_analyze() -> None:
    """The test runs ``systemd-analyze``."""
    require_tool("systemd-analyze")


def _installed_copy(tmp_path: Path, unit: str) -> Path:
    """``unit`` copied into ``tmp_path`` with ExecStart pointing at this environment's
    ``sidecar`` (verify checks that the binary exists); a template gets an instance name.
    """
    binary = Path(sys.executable).parent / "sidecar"
    assert binary.exists(), f"the console script {binary} is not installed (pip install -e .)"
    text = (UNITS / unit).read_text()
    assert "/opt/trainmon/bin/sidecar" in text
    target = tmp_path / unit.replace("@.", "@trainmon-test.")
    target.write_text(text.replace("/opt/trainmon/bin/sidecar", str(binary)))
    return target


@needs_analyze
@pytest.mark.parametrize("unit", sorted(RECORDED_EXPOSURE))
def test_unit_verifies_without_a_word(tmp_path: Path, unit: str) -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", str(_installed_copy(tmp_path, unit))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""


@needs_analyze
@pytest.mark.parametrize("unit", sorted(RECORDED_EXPOSURE))
def test_hardening_keeps_the_recorded_exposure(tmp_path: Path, unit: str) -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(_installed_copy(tmp_path, unit))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= RECORDED_EXPOSURE[unit]
    # The GPUs stay visible: PrivateDevices= would hide /dev/nvidia*.
    assert "PrivateDevices=yes" not in (UNITS / unit).read_text()
    assert "char-nvidia*:rw" in result.stdout


def test_slurm_scripts_are_valid_shell() -> None:
    for script in sorted((UNITS / "slurm").iterdir()):
        shell = "bash" if script.suffix == ".sbatch" else "sh"
        subprocess.run([shell, "-n", str(script)], check=True, timeout=30)


def _options(unit_text: str) -> dict[str, str]:
    """The unit's Environment= values, then the options file's (as installed)."""
    values: dict[str, str] = {}
    for line in unit_text.splitlines():
        if line.startswith("Environment="):
            values.update(word.split("=", 1) for word in shlex.split(line[len("Environment=") :]))
    for line in (UNITS / "sidecar.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def _exec_start(unit: str, run_dir: Path, state_dir: Path) -> list[str]:
    """The unit's ExecStart command as systemd would run it for instance "root", with
    /run and /var/lib moved into the test's folders and the console script replaced by
    this interpreter."""
    text = (UNITS / unit).read_text()
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    options = _options(text)
    options["SIDECAR_ROOT"] = str(state_dir / "sidecar")  # not /var/lib/sidecar
    words = []
    for word in line[len("ExecStart=") :].split():
        word = word.replace("%t", str(run_dir)).replace("%S", str(state_dir))
        word = word.replace("%i", "root")
        if word.startswith("$") and not word.startswith("${"):
            words += options.get(word[1:], "").split()  # $VAR: split into words
            continue
        words.append(re.sub(r"\$\{(\w+)\}", lambda m: options[m.group(1)], word))
    assert words[0] == "/opt/trainmon/bin/sidecar"
    return [sys.executable, "-m", "sidecar", *words[1:]]


@pytest.mark.skipif(os.geteuid() != 0, reason="the shared unit's daemon runs as root")
@pytest.mark.parametrize("unit", sorted(RECORDED_EXPOSURE))
def test_exec_start_runs_a_daemon_that_says_ready(short_tmp: Path, unit: str) -> None:
    run_dir, state_dir = short_tmp / "run", short_tmp / "lib"
    # what RuntimeDirectory= and StateDirectory= create before ExecStart
    (run_dir / ("sidecar" if "@" not in unit else "sidecar-root")).mkdir(parents=True)
    (state_dir / "sidecar" / ("root" if "@" in unit else "")).mkdir(parents=True)
    command = _exec_start(unit, run_dir, state_dir)
    endpoint = command[command.index("--endpoint") + 1]
    manager = Manager(short_tmp / "notify")
    log = (short_tmp / "daemon.log").open("ab")
    daemon = subprocess.Popen(
        command,
        env=env(NOTIFY_SOCKET=str(manager.path), WATCHDOG_USEC="30000000"),
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    try:
        manager.until("READY=1", 30)
        view = status(endpoint, 5)
        assert view is not None and view["root"].startswith(str(state_dir))
        daemon.send_signal(signal.SIGTERM)
        manager.until("STOPPING=1", 10)
        assert daemon.wait(20) == 128 + signal.SIGTERM  # SuccessExitStatus= lists it
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        manager.sock.close()
    assert (
        str(128 + signal.SIGTERM)
        in (UNITS / unit).read_text().split("SuccessExitStatus=")[1].split("\n")[0].split()
    )
