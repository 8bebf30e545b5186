"""Every PromQL expression the docs show, and their scrape config, against a real
Prometheus: the server runs with the docs' own scrape config (only the targets pointed at
the test's sidecar), scrapes a real marked loop under ``sidecar run --metrics-port`` on two
stand-in GPUs (one busy, one idle), and each expression must return what the docs say,
checked against the loop's own files.

Expressions are taken from the fenced ``promql`` blocks of README.md and docs/*.md (blank
lines separate expressions in a block), so one added to the docs is run here; one without
a check in ``CHECKS`` fails the test, which asks for it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from markers import wire
from tests.support.helpers import env, read_tsv
from tests.support.prometheus import (
    free_port,
    marked_loop,
    prometheus_server,
    promql,
    start_loop_job,
)
from tests.support.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDLE_UUID = "GPU-6a6a6a6a"  # tests.support.fake_pynvml.busy_and_idle_gpu: 3 %
# input 6 ms, forward 4 ms, backward 1 ms: data loading ~55 % of the iteration
LOOP = marked_loop(input_s=0.006)
Result = list[dict[str, Any]]


def fenced(language: str) -> list[tuple[str, str]]:
    """(document name, block text) of every fenced block of ``language`` in the docs."""
    found = []
    for doc in DOCS:
        for block in re.findall(rf"^```{language}\n(.*?)^```", doc.read_text(), re.M | re.S):
            found.append((doc.relative_to(ROOT).as_posix(), block))
    return found


def expressions() -> list[tuple[str, str]]:
    """(document name, expression) of every PromQL expression the docs show."""
    return [
        (doc, part.strip())
        for doc, block in fenced("promql")
        for part in re.split(r"\n\s*\n", block)
        if part.strip()
    ]


def _key(expression: str) -> str:
    """The expression without its comments and whitespace."""
    return re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", expression))


def _value(result: Result) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def _near(value: float, expected: float, rel: float) -> None:
    assert abs(value - expected) <= rel * expected, (value, expected)


def _forward(result: Result, files: dict[str, float]) -> None:
    assert result[0]["metric"]["phase"] == "forward"
    _near(_value(result), files["forward_s"], 0.25)


def _idle(result: Result, files: dict[str, float]) -> None:
    assert [r["metric"]["uuid"] for r in result] == [IDLE_UUID]
    assert abs(_value(result) - 0.03) < 0.005


def _input_bound(result: Result, files: dict[str, float]) -> None:
    assert "phase" not in result[0]["metric"]  # the two phases were matched
    # absolute tolerance: the Prometheus window and the stored rows are different stretches
    # of the same loop, and a busy machine stretches every sleep a little
    assert abs(_value(result) - files["loading_share"]) <= 0.1, (result, files)
    assert _value(result) > 0.3


def _throughput(result: Result, files: dict[str, float]) -> None:
    assert result[0]["metric"]["loop"] == "train"
    _near(_value(result), files["throughput"], 0.25)


def _status(result: Result, files: dict[str, float]) -> None:
    assert result[0]["metric"]["status"] == "running" and _value(result) == 1


def _goodput_share(result: Result, files: dict[str, float]) -> None:
    # the live account from the process start: productive is the loop without its waits
    # for data, so at most the loop's share that is not loading
    assert result[0]["metric"]["rank"] == "0" and "part" not in result[0]["metric"]
    assert 0.05 < _value(result) <= 1 - files["loading_share"] + 0.1, (result, files)


def _badput_by_user(result: Result, files: dict[str, float]) -> None:
    hours = {r["metric"]["part"]: float(r["value"][1]) for r in result}
    assert {r["metric"]["user"] for r in result} == {files["user"]}
    assert all(value >= 0 for value in hours.values()) and hours["data_stall"] > 0, hours


def _phase_shares(result: Result, files: dict[str, float]) -> None:
    shares = {r["metric"]["phase"]: float(r["value"][1]) for r in result}
    assert set(shares) == {"train_loading", "forward", "backward"}, shares
    assert abs(shares["train_loading"] - files["loading_share"]) <= 0.1, (shares, files)
    assert sum(shares.values()) <= 1.05, shares


def _gpu_hours_by_user(result: Result, files: dict[str, float]) -> None:
    # two GPUs for the job's wall time so far (seconds to minutes)
    assert result[0]["metric"]["user"] == files["user"]
    assert 0 < _value(result) < 2 * 600 / 3600, result


# the PromQL matcher over the step parts (tests/unit/test_phase_table.py holds the docs to it)
STEP_PHASES = "|".join(p.metric for p in wire.STEP_PHASES)
# what each expression of the docs returns, by its text without whitespace
CHECKS: dict[str, Callable[[Result, dict[str, float]], None]] = {
    _key(e): check
    for e, check in (
        (
            'rate(trainmon_phase_duration_seconds_sum{phase="forward"}[5m]) '
            '/ rate(trainmon_phase_duration_seconds_count{phase="forward"}[5m])',
            _forward,
        ),
        ("avg_over_time(trainmon_gpu_utilization_ratio[15m]) < 0.1", _idle),
        (
            '(rate(trainmon_phase_duration_seconds_sum{phase="train_loading",rank="0"}[10m]) '
            '/ rate(trainmon_phase_duration_seconds_count{phase="train_loading",rank="0"}[10m])) '
            "/ ignoring(phase) "
            '(rate(trainmon_phase_duration_seconds_sum{phase="train_loop",rank="0"}[10m]) '
            '/ rate(trainmon_phase_duration_seconds_count{phase="train_loop",rank="0"}[10m])) '
            "> 0.3",
            _input_bound,
        ),
        ('irate(trainmon_samples_total{loop="train"}[1m])', _throughput),
        ("trainmon_run_status == 1", _status),
        (
            'trainmon_goodput_seconds{part="productive"} / ignoring(part) '
            "trainmon_goodput_wall_seconds",
            _goodput_share,
        ),
        (
            'sum by (user, part) (trainmon_goodput_seconds{part!="productive"}) / 3600',
            _badput_by_user,
        ),
        (
            "sum by (phase) (rate(trainmon_phase_duration_seconds_sum"
            f'{{phase=~"{STEP_PHASES}"}}[5m])) / ignoring(phase) '
            'group_left sum(rate(trainmon_phase_duration_seconds_sum{phase="train_loop"}[5m]))',
            _phase_shares,
        ),
        (
            "sum by (user) (max by (user, run) (trainmon_goodput_wall_seconds) * on (run) "
            "group_left count by (run) (trainmon_gpu_utilization_ratio)) / 3600",
            _gpu_hours_by_user,
        ),
    )
}


def scrape_config() -> dict[str, Any]:
    """The docs' scrape config (every copy of it in the docs must be the same)."""
    configs = [yaml.safe_load(block) for _, block in fenced("yaml") if "scrape_configs" in block]
    assert configs and all(c == configs[0] for c in configs), configs
    return configs[0]


def test_the_docs_scrape_config_passes_promtool(tmp_path: Path) -> None:
    require_tool("promtool")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape_config()))
    check = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_promql_expression_of_the_docs_returns_what_they_say(tmp_path: Path) -> None:
    shown = expressions()
    assert len(shown) >= 5, shown
    unchecked = sorted({e for _, e in shown if _key(e) not in CHECKS})
    assert not unchecked, f"say in CHECKS what these expressions return: {unchecked}"
    target = free_port()
    config = scrape_config()
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [f"127.0.0.1:{target}"]
    with prometheus_server(tmp_path, yaml.safe_dump(config)) as url:
        job, stop = start_loop_job(tmp_path, target, script=LOOP, gpus="busy_and_idle_gpu")
        try:
            # the docs' scrape interval: every expression has data after two scrapes
            deadline = time.monotonic() + 180
            while True:
                results = {e: promql(url, e) for _, e in shown}
                empty = [e for e, found in results.items() if not found]
                if not empty:
                    break
                assert time.monotonic() < deadline, f"nothing returned after 180 s: {empty}"
                time.sleep(1.0)
        finally:
            stop.touch()
            _, stderr = job.communicate(timeout=60)
    assert job.returncode == 0, stderr
    logs = tmp_path / "runs" / "job" / "training" / "split-0" / "logs"
    table = read_tsv(logs / "computational.tsv")
    report = subprocess.run(
        [sys.executable, "-m", "sidecar", "report", "runs", "--out", "r"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    row = read_tsv(tmp_path / "r" / "jobs.tsv").iloc[0]
    files = {
        "forward_s": table["Forward (s)"].mean(),
        "loading_share": table["Training data loading (s)"].mean()
        / table["Training loop (s)"].mean(),
        "throughput": row["train throughput (samples/s)"],
        "user": row["user"],
    }
    for doc, expression in shown:
        try:
            CHECKS[_key(expression)](results[expression], files)
        except AssertionError as exc:
            pytest.fail(f"{doc}: {expression}\nreturned {results[expression]}: {exc}")
