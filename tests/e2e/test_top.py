"""``sidecar top`` in a real terminal (tmux) beside a real marked job (docs/views.md): it
shows the run, its iteration advancing and its phase shares, near the loop's own clock;
``q`` leaves with status 0; no sidecar is one line and status 1. On a shared daemon a
user sees only their own run, which stays shown once ended, and the admin's token shows
every run.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import local_users
from tests.support.fake_pynvml import RANK_GPUS
from tests.support.helpers import (
    SAME_PRIORITY,
    Sidecar,
    env,
    sidecar_command,
    wait_for,
)
from tests.support.shared_node import prepare, start_shared, user_job
from tests.support.tools import require_tool

JOB = Path(__file__).resolve().parents[1] / "support" / "jobs" / "paced_job.py"
RANK_LINE = re.compile(r"^\s+0\s+(\d+)\s+(\d+)\s+([\d.]+)ms")
LONG_SOCKET = "a-sidecar-run-endpoint-with-a-long-name-for-the-header.sock"
HEADER = re.compile(r"^sidecar top: pid \d+ on .+, \d\d:\d\d:\d\d; q quits$")
SHARES = re.compile(r"phases: data loading (\d+)%, forward (\d+)%, backward (\d+)%")


@pytest.fixture(autouse=True)
def _tmux() -> None:
    require_tool("tmux")


class Pane:
    """A command in a detached tmux session of 80 × 40 on a server of its own."""

    def __init__(self, folder: Path, command: list[str]) -> None:
        self.socket = str(folder / "tmux.sock")
        self.rc_file = folder / "top.rc"
        self.rc_file.unlink(missing_ok=True)
        line = " ".join(f"'{part}'" for part in command)
        script = folder / "pane.sh"
        exports = " ".join(f"{k}='{v}'" for k, v in env().items() if k in ("PYTHONPATH", "PATH"))
        # the shell survives a Ctrl-C meant for the command (a handler, not an ignore: the
        # command gets the default), to write down its status
        script.write_text(
            f"trap true INT\nexport {exports} TERM=xterm-256color\n{line}\n"
            f"echo $? > {self.rc_file}\n"
        )
        self._tmux("new-session", "-d", "-s", "top", "-x", "80", "-y", "40", f"sh {script}")

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=30
        )
        return done.stdout

    def screen(self) -> str:
        """What the pane shows now."""
        return self._tmux("capture-pane", "-p", "-t", "top")

    def press(self, key: str) -> None:
        self._tmux("send-keys", "-t", "top", key)

    def exit_status(self) -> int | None:
        try:
            return int(self.rc_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def close(self) -> None:
        self._tmux("kill-server")


@pytest.fixture
def panes() -> Iterator[Callable[[Path, list[str]], Pane]]:
    opened: list[Pane] = []

    def open_pane(folder: Path, command: list[str]) -> Pane:
        opened.append(Pane(folder, command))
        return opened[-1]

    yield open_pane
    for pane in opened:
        pane.close()


def _rank0(screen: str) -> tuple[int, float] | None:
    """(iteration, step ms) of rank 0's line, when shown."""
    match = next((m for m in map(RANK_LINE.match, screen.splitlines()) if m), None)
    return (int(match[2]), float(match[3])) if match else None


def test_top_follows_a_live_run_and_q_quits(
    short_tmp: Path, panes: Callable[[Path, list[str]], Pane]
) -> None:
    # a long endpoint (as a ``sidecar run`` socket path is): the header keeps its clock
    endpoint = f"ipc://{short_tmp}/{LONG_SOCKET}"
    stop, truth = short_tmp / "stop", short_tmp / "truth.json"
    job = subprocess.Popen(
        [
            *sidecar_command("run", "--quiet", *SAME_PRIORITY, "--endpoint", endpoint),
            "--",
            sys.executable,
            str(JOB),
            "--out-dir",
            "live",
            "--epochs",
            "1",
            "--iters",
            "30",
            "--hold-file",
            str(stop),
            "--truth",
            str(truth),
        ],
        cwd=short_tmp,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for((short_tmp / LONG_SOCKET).exists, 60, "the sidecar's socket")
        pane = panes(short_tmp, sidecar_command("top", "--endpoint", endpoint))
        first = wait_for(lambda: _rank0(pane.screen()), 60, "rank 0's line in top")
        later = wait_for(
            lambda: (r := _rank0(pane.screen())) and r[0] > first[0] and r, 60, "a later iteration"
        )
        screen = pane.screen()
        print(screen)
        assert "live" in screen and "running" in screen, screen
        header = screen.splitlines()[0]
        assert HEADER.match(header) and len(header) <= 80, screen
        shares = SHARES.search(screen)
        assert shares, screen
        # against the loop's own clock: its steps and forwards (written per epoch)
        own = wait_for(lambda: truth.exists() and json.loads(truth.read_text()), 60, "truth")
        step_ms = statistics.median(own["step_s"]) * 1e3
        forward_pct = statistics.median(own["forward_s"]) / statistics.median(own["step_s"]) * 100
        print(
            f"top: step {later[1]} ms, forward {shares[2]} %; loop's clock {step_ms:.1f} ms, "
            f"{forward_pct:.0f} %"
        )
        assert 0.5 * step_ms < later[1] < 2 * step_ms, (later, step_ms)
        assert abs(int(shares[2]) - forward_pct) < 20, (shares[0], forward_pct)
        pane.press("q")
        assert wait_for(lambda: pane.exit_status() is not None, 30, "top to exit") and (
            pane.exit_status() == 0
        )
        pane.close()
        again = panes(short_tmp, sidecar_command("top", "--endpoint", endpoint))
        wait_for(lambda: _rank0(again.screen()), 60, "rank 0's line in top again")
        again.press("C-c")
        assert wait_for(lambda: again.exit_status() is not None, 30, "top to exit on Ctrl-C")
        assert again.exit_status() == 0
    finally:
        stop.touch()
        job.communicate(timeout=120)


def test_no_sidecar_is_one_line_and_status_1(short_tmp: Path) -> None:
    done = subprocess.run(
        sidecar_command("top", "--endpoint", f"ipc://{short_tmp}/none.sock"),
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "no sidecar at" in done.stderr and not done.stdout


WHY_NOT = local_users.unavailable() or local_users.user_python_unavailable()


@pytest.mark.skipif(bool(WHY_NOT), reason=str(WHY_NOT))
def test_a_user_sees_only_their_run_which_stays_shown_once_ended(
    serve: Callable[..., Sidecar], short_tmp: Path, panes: Callable[[Path, list[str]], Pane]
) -> None:
    site = prepare(short_tmp)
    admin = short_tmp / "admin-token"
    admin.write_text("the-admins-token\n")
    admin.chmod(0o644)  # a test file: the user reads it to show the admin's view
    daemon = start_shared(serve, "--metrics-port", "0", "--metrics-token-file", str(admin))
    with local_users.local_users(2, tag="t") as (alice, bob):
        stops = {user: short_tmp / f"stop-{user}" for user in (alice, bob)}
        jobs = [
            user_job(
                user,
                site,
                daemon.endpoint,
                short_tmp,
                "paced_job",
                "--out-dir",
                f"maps-{user}",
                "--epochs",
                "1",
                "--hold-file",
                str(stops[user]),
            )
            for user in (alice, bob)
        ]
        try:
            wait_for(lambda: len(daemon.status()["runs"]) == 2, 60, "both runs")
            as_alice = [sys.executable, "-m", "tests.support.as_user", alice]
            pane = panes(short_tmp, [*as_alice, "top", "--endpoint", daemon.endpoint])
            wait_for(lambda: _rank0(pane.screen()), 60, "alice's run in top")
            screen = pane.screen()
            assert f"maps-{alice}" in screen and f"maps-{bob}" not in screen, screen
            assert bob not in screen, screen
            stops[alice].touch()
            ended = wait_for(lambda: "ended" in (s := pane.screen()) and s, 60, "ended shown")
            print(ended)
            assert f"maps-{alice}" in ended and f"maps-{bob}" not in ended, ended
            pane.press("q")
            wait_for(lambda: pane.exit_status() is not None, 30, "top to exit")
            assert pane.exit_status() == 0
            seen_all = subprocess.run(
                [
                    *as_alice,
                    "top",
                    "--endpoint",
                    daemon.endpoint,
                    "--once",
                    "--token-file",
                    str(admin),
                ],
                env=env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert seen_all.returncode == 0, seen_all.stderr
            assert f"maps-{bob}" in seen_all.stdout and f"maps-{alice}" in seen_all.stdout
        finally:
            for stop in stops.values():
                stop.touch()
            for job in jobs:
                job.communicate(timeout=120)


def test_gpus_and_the_straggler_of_four_ranks(short_tmp: Path) -> None:
    """Four ranks on one sidecar, each reporting its GPU (the fake NVML holds rank 2's at
    120 W, the others at 300 W); rank 2's data loading is slowed: top shows every rank,
    each GPU's power, and rank 2 as the straggler in data loading."""
    endpoint = f"ipc://{short_tmp}/g.sock"
    hold = short_tmp / "hold"
    job = subprocess.Popen(
        [
            *sidecar_command(
                "run",
                "--quiet",
                *SAME_PRIORITY,
                "--endpoint",
                endpoint,
                "--interval",
                "0.2",
                seams=("--fake-nvml", "rank_gpus_third_throttled"),
            ),
            "--",
            sys.executable,
            str(JOB.parent / "ranks_job.py"),
            "--spawn",
            "0,1,2,3",
            "--world",
            "4",
            "--truth",
            str(short_tmp),
            "--iters",
            "30",
            "--slow-rank",
            "2",
            "--slow-s",
            "0.05",
            "--gpu-uuids",
            ",".join(RANK_GPUS),
            "--hold-file",
            str(hold),
        ],
        cwd=short_tmp,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def view() -> str | None:
        done = subprocess.run(
            sidecar_command("top", "--endpoint", endpoint, "--once"),
            env=env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout if "straggler rank" in done.stdout else None

    try:
        wait_for((short_tmp / "g.sock").exists, 60, "the sidecar's socket")
        shown = wait_for(view, 120, "the straggler in top", interval_s=1.0)
        print(shown)
        assert re.search(r"straggler rank 2 on \S+ \(data loading\)", shown), shown
        ranks = [
            int(m[1])
            for m in map(re.compile(r"^\s+(\d)\s+\d+\s+\d+").match, shown.splitlines())
            if m
        ]
        assert ranks == [0, 1, 2, 3], shown
        powers = dict(re.findall(r"GPU (\d) NVIDIA Fake: .* (\d+) W", shown))
        assert powers == {"0": "300", "1": "300", "2": "120", "3": "300"}, shown
        assert all(len(line) <= 80 for line in shown.splitlines()), shown
    finally:
        hold.touch()
        job.communicate(timeout=120)
