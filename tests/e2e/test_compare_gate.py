"""``sidecar compare``'s gate against noise (docs/views.md, "The gate"), on real runs under
the real sidecar while ``stress-ng --cpu 1`` keeps a core busy: ten pairs of runs of the
same script pass ``--max-regression 5`` but for at most one, one run a side (blocks of
each run over time as the units); the ten against the ten (folders of runs, the runs as
units) pass; a forward 10 % and 30 % slower on the loop's own clock fails it, naming
Forward. Every line fits 80 columns. Short runs of many small steps, made once for the
module, two at a time (never two runs that are compared with each other). The loop's
phases sleep whole (``--spin-s 0``): a loop that spins its phases' ends competes with
stress-ng for the CPU and its step time takes two modes (5.6 and ~10 ms here), whose
median jumps between them from block to block; the gate's interval then spans ±20 %
and rightly catches no 10 % change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.helpers import SAME_PRIORITY, env, sidecar_command
from tests.support.tools import require_tool

JOB = Path(__file__).resolve().parents[1] / "support" / "jobs" / "paced_job.py"
FORWARD_S = 0.005  # most of a step (~5.6 ms), so a slower forward is a slower step
PAIRS = 10
SLOWER = {"slow10": 1.10, "slow30": 1.30}
GATE_PCT = "5"
WIDTH = 80
EPOCHS, ITERS = 16, 13  # 208 steps a run, 16 epochs: the units of a one-run side
TOGETHER = 2  # runs (and comparisons) made at once: 4 overloaded 2 cores, +15 s

# alone: its runs are made beside one busy core (stress-ng), not beside the other tests too
pytestmark = [pytest.mark.slow, pytest.mark.alone]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder of every run, made while stress-ng keeps one CPU busy: ``base/run-i``
    and ``again/run-i`` (the pairs), ``slow10`` and ``slow30``."""
    require_tool("stress-ng")
    cwd = tmp_path_factory.mktemp("gate")
    stress = subprocess.Popen(
        ["stress-ng", "--cpu", "1", "--timeout", "600s", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        names = []
        for first in range(0, PAIRS, TOGETHER):  # never beside the run it is compared with
            pairs = range(first, min(first + TOGETHER, PAIRS))
            names += [[f"{side}/run-{i}" for i in pairs] for side in ("base", "again")]
        names.append(list(SLOWER))
        for together in names:
            started = [_start(cwd, name, FORWARD_S * SLOWER.get(name, 1.0)) for name in together]
            for process in started:
                _, stderr = process.communicate(timeout=240)
                assert process.returncode == 0, stderr
        yield cwd
    finally:
        stress.terminate()
        stress.wait(timeout=30)


def _start(cwd: Path, name: str, forward_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *sidecar_command("run", "--quiet", *SAME_PRIORITY),
            "--",
            sys.executable,
            str(JOB),
            *("--out-dir", name, "--epochs", str(EPOCHS), "--iters", str(ITERS)),
            *("--cap", "400", "--warmup", "1", "--forward-s", str(forward_s)),
            *("--loading-s", "0.0002", "--backward-s", "0.0002", "--optimization-s", "0.0002"),
            *("--spin-s", "0"),  # phases slept whole: the loop holds no CPU while it waits
        ],
        cwd=cwd,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _gates(cwd: Path, *comparisons: tuple[str, ...]) -> list[tuple[int, str]]:
    """(exit status, the deciding line unwrapped) of the gate over each comparison's
    folders, ``TOGETHER`` at a time."""
    verdicts = []
    for first in range(0, len(comparisons), TOGETHER):
        started = [
            subprocess.Popen(
                sidecar_command("compare", *folders, "--max-regression", GATE_PCT),
                cwd=cwd,
                env=env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for folders in comparisons[first : first + TOGETHER]
        ]
        for process in started:
            stdout, stderr = process.communicate(timeout=120)
            verdicts.append(_verdict(process.returncode, stdout, stderr))
    return verdicts


def _verdict(status: int, stdout: str, stderr: str) -> tuple[int, str]:
    assert status in (0, 1), stderr
    lines = stdout.splitlines()
    assert max(map(len, lines)) <= WIDTH, stdout
    first = max(i for i, line in enumerate(lines) if line.startswith(("PASS", "FAIL")))
    return status, " ".join(line.strip() for line in lines[first:])


def test_same_code_passes_at_its_stated_rate_and_slower_forwards_fail(runs: Path) -> None:
    *verdicts, pooled, slow10, slow30 = _gates(
        runs,
        *((f"base/run-{i}", f"again/run-{i}") for i in range(PAIRS)),
        ("base", "--", "again"),  # folders of runs: the runs as units
        ("base/run-0", "slow10"),
        ("base/run-0", "slow30"),
    )
    print("\n".join(line for _, line in verdicts))
    assert sum(status == 1 for status, _ in verdicts) <= 1, verdicts
    print(f"ten against ten: {pooled[1]}")
    assert pooled[0] == 0, pooled
    for name, (status, line) in (("slow10", slow10), ("slow30", slow30)):
        print(f"forward x{SLOWER[name]}: {line}")
        assert status == 1 and line.startswith("FAIL: step time"), line
        assert "most of it Forward" in line, line


def test_the_sides_say_their_runs_and_units(runs: Path) -> None:
    done = subprocess.run(
        sidecar_command("compare", "base/run-0", "base/run-1", "--", "slow30", "--json"),
        cwd=runs,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(done.stdout)
    assert (result["base"]["runs"], result["base"]["unit"], result["base"]["units"]) == (
        2,
        "runs",
        2,
    )
    assert (result["new"]["runs"], result["new"]["unit"], result["new"]["units"]) == (
        1,
        "epochs",
        EPOCHS,
    )
