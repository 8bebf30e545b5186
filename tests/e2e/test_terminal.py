"""A job under ``sidecar run`` in a terminal behaves as when started directly (docs/contract.md,
Faults and bad input: input, pdb, Ctrl-C, Ctrl-Z). A real pseudo-terminal from util-linux
``script``; the keys are typed into it.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from tests.support.helpers import JOB as LOOP_JOB
from tests.support.helpers import (
    REPO,
    env,
    job_args,
    progress,
    read_tsv,
    run_json,
    split_dir,
    under_sidecar_run,
    wait_for,
)
from tests.support.tools import require_tool

JOB = REPO / "tests" / "support" / "jobs" / "terminal_job.py"


@pytest.fixture(autouse=True)
def _script() -> None:
    """Every test here runs util-linux ``script`` (a pseudo-terminal)."""
    require_tool("script")


class Terminal:
    """An interactive bash (with job control) in a pseudo-terminal; ``type`` sends keys,
    ``screen`` is what the terminal shows."""

    def __init__(self, cwd: Path) -> None:
        self.process = subprocess.Popen(
            ["script", "-qfec", "bash --norc --noprofile -i", "/dev/null"],
            cwd=cwd,
            env=env(PYTHONBREAKPOINT="", TERM="dumb", PS1="$ ", XDG_RUNTIME_DIR=str(cwd)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.screen = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        while chunk := self.process.stdout.read1(4096):
            self.screen += chunk.decode(errors="replace")

    def type(self, keys: str) -> None:
        """Type ``keys`` (control characters included) into the terminal."""
        assert self.process.stdin is not None
        self.process.stdin.write(keys.encode())
        self.process.stdin.flush()

    def wait_for(self, text: str, timeout_s: float = 60) -> str:
        """Wait until ``text`` appears on the screen; the screen after it."""
        wait_for(
            lambda: text in self.screen,
            timeout_s,
            f"{text!r} on the screen; it shows {self.screen[-500:]!r}",
        )
        return self.screen.rsplit(text, 1)[1]


def test_job_reads_the_terminal_takes_ctrl_z_ctrl_c_and_stops_in_pdb(tmp_path: Path) -> None:
    terminal = Terminal(tmp_path)
    terminal.type(
        shlex.join(
            [sys.executable, "-m", "sidecar", "run", "--quiet", "--", sys.executable, str(JOB)]
        )
        + "\n"
    )
    pid = int(terminal.wait_for("ready ").split()[0])
    terminal.wait_for("name? ")
    terminal.type("world\n")  # input() gets the line: no SIGTTIN, no stop
    terminal.wait_for("hello world")
    terminal.wait_for("training")
    job = psutil.Process(pid)
    sidecar = job.parent()
    assert sidecar is not None and "sidecar" in " ".join(sidecar.cmdline())

    terminal.type("\x1a")  # Ctrl-Z: job and sidecar stop; the shell has the terminal back
    wait_for(lambda: job.status() == psutil.STATUS_STOPPED, 10, "the job to stop")
    wait_for(lambda: sidecar.status() == psutil.STATUS_STOPPED, 10, "the sidecar to stop")
    terminal.wait_for("Stopped")
    terminal.type("fg\n")
    wait_for(lambda: job.status() != psutil.STATUS_STOPPED, 10, "the job to go on")
    wait_for(lambda: sidecar.status() != psutil.STATUS_STOPPED, 10, "the sidecar to go on")

    terminal.type("\x03")  # Ctrl-C: one KeyboardInterrupt, in the job only
    terminal.wait_for("interrupted")
    terminal.wait_for("(Pdb) ")
    # Readline may discard what is typed in the instant it sets up the terminal after the
    # prompt: the command is typed again until pdb answers.
    for _ in range(5):
        terminal.type("p 6 * 7\n")
        try:
            terminal.wait_for("\n42", 3)
            break
        except AssertionError:
            continue
    terminal.type("c\n")
    terminal.wait_for("leaving")
    terminal.type("echo status=$?\n")
    terminal.wait_for("status=0")  # the job's exit status
    terminal.type("exit\n")
    terminal.process.wait(30)
    document = run_json(tmp_path / "maps")
    assert document["status"] == "completed"
    phases = read_tsv(split_dir(tmp_path / "maps") / "logs" / "phases.tsv")
    assert (phases.iloc[:, 0] == "Forward").sum() > 0
    assert "Traceback" not in terminal.screen


def test_closing_the_terminal_writes_the_files_and_leaves_no_socket_folder(tmp_path: Path) -> None:
    terminal = Terminal(tmp_path)
    terminal.type(
        shlex.join(
            under_sidecar_run(
                LOOP_JOB,
                *job_args(
                    out_dir="maps",
                    iters=50,
                    stop_file=tmp_path / "never",
                    progress=tmp_path / "p.json",
                ),
            )
        )
        + "\n"
    )
    job = wait_for(
        lambda: (
            progress(tmp_path / "p.json").get("iterations", 0) >= 200
            and progress(tmp_path / "p.json")
        ),
        60,
        "the job to train",
    )
    sidecar = psutil.Process(job["pid"]).parent()
    assert sidecar is not None
    terminal.process.kill()  # the terminal window closes: the kernel hangs the terminal up
    document = wait_for(
        lambda: (
            run_json(tmp_path / "maps").get("status") == "incomplete"
            and run_json(tmp_path / "maps")
        ),
        30,
        "the run written",
    )
    assert document["cause"] == "job killed by signal 1 (SIGHUP)"
    wait_for(
        lambda: not sidecar.is_running() or sidecar.status() == psutil.STATUS_ZOMBIE,
        30,
        "the sidecar to exit",
    )
    assert not list((tmp_path / "sidecar").glob("job-*"))
