"""``sidecar compare`` on real runs of one script (docs/views.md): the same script twice
passes the gate; the same script with its forward made 20 % slower on the loop's own
clock fails it, naming Forward with the difference measured; unlike runs are compared
where they can be and their differences said.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import SAME_PRIORITY, env, sidecar_command

JOB = Path(__file__).resolve().parents[1] / "support" / "jobs" / "paced_job.py"
FORWARD_S = 0.050
SLOWER = 1.20  # the new forward's time over the base's
WIDTH = 80  # columns of every line of the text form
GATE_PCT = "8"  # step time grows by ~19 % with a 20 % slower forward (~95 % of a step)


def _run(cwd: Path, name: str, *job: str) -> Path:
    """Run the paced job under ``sidecar run`` into ``cwd/name``; its truth file."""
    truth = cwd / f"{name}.json"
    done = subprocess.run(
        [
            *sidecar_command("run", "--quiet", *SAME_PRIORITY),
            "--",
            sys.executable,
            str(JOB),
            "--out-dir",
            name,
            "--truth",
            str(truth),
            "--loading-s",
            "0.001",
            "--backward-s",
            "0.002",
            "--optimization-s",
            "0.001",
            "--iters",
            "30",
            *job,
        ],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return truth


def _compare(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        sidecar_command("compare", *args),
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "--json" not in args:
        wide = [line for line in done.stdout.splitlines() if len(line) > WIDTH]
        assert not wide, done.stdout
    return done


def _verdict(stdout: str) -> str:
    """The gate's verdict: its wrapped lines, from PASS or FAIL on, as one line."""
    lines = stdout.splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith(("PASS", "FAIL")))
    return " ".join(line.strip() for line in lines[first:])


def _figure(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in [*result["phases"], *result["figures"]] if f["name"] == name)


# Its forward medians agree with the loop's own to 1 %: other tests beside it skew them.
@pytest.mark.alone
def test_same_script_passes_and_a_slower_forward_fails_naming_forward(short_tmp: Path) -> None:
    base = _run(short_tmp, "base", "--forward-s", str(FORWARD_S))
    again = _run(short_tmp, "again", "--forward-s", str(FORWARD_S))
    slow = _run(short_tmp, "slow", "--forward-s", str(FORWARD_S * SLOWER))

    same = _compare(short_tmp, "base", "again", "--max-regression", GATE_PCT)
    assert same.returncode == 0, same.stdout + same.stderr
    assert _verdict(same.stdout).startswith("PASS: step time"), same.stdout

    worse = _compare(short_tmp, "base", "slow", "--max-regression", GATE_PCT)
    assert worse.returncode == 1, worse.stdout + worse.stderr
    decided = _verdict(worse.stdout)
    assert decided.startswith("FAIL: step time") and "most of it Forward" in decided, decided

    measured = json.loads(_compare(short_tmp, "base", "slow", "--json").stdout)
    forward = _figure(measured, "Forward")
    # the loop's own clock: its forwards' medians after the warmup
    own = [statistics.median(json.loads(t.read_text())["forward_s"][2:]) for t in (base, slow)]
    own_pct = (own[1] / own[0] - 1) * 100
    print(
        f"Forward: compare says {forward['change_pct']:+.2f} %, the loop's clock {own_pct:+.2f} %"
    )
    assert abs(forward["change_pct"] - 20) < 5, forward
    assert abs(forward["change_pct"] - own_pct) < 1, (forward, own_pct)
    low, high = forward["change_ci"]
    assert low <= forward["change_pct"] <= high and high - low < 10, forward
    assert measured["unlike"] == []
    del again


def test_unlike_runs_are_compared_where_they_can_be(short_tmp: Path) -> None:
    _run(short_tmp, "base", "--epochs", "1")
    _run(short_tmp, "other", "--epochs", "1", "--batch-size", "32", "--validate")
    done = _compare(short_tmp, "base", "other", "--max-regression", "10")
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr
    said = " ".join(done.stdout.split())  # the wrapped lines as one text
    assert "Unlike runs: batch size differs (16 vs 32)" in said, done.stdout
    assert "only in NEW: Evaluation" in said, done.stdout
    assert "throughput" in done.stdout and "Forward" in done.stdout


def test_command_line_mistakes_are_one_line_and_exit_2(short_tmp: Path) -> None:
    for args in (("nowhere", "nowhere"), (".", ".", "--max-regression", "-3")):
        done = _compare(short_tmp, *args)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    done = _compare(short_tmp, ".", ".")  # a folder, but no run folder: one line, exit 1
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
