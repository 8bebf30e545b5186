"""deploy/prometheus/trainmon.rules.yml: valid for promtool, and each alert fires (and
stays quiet) on the series written for it in trainmon.rules.test.yml."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.tools import require_tool

RULES = Path(__file__).parents[2] / "deploy" / "prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    require_tool("promtool")
    return subprocess.run(
        ["promtool", *args], cwd=RULES, capture_output=True, text=True, timeout=120
    )


def test_rules_check() -> None:
    result = _promtool("check", "rules", "trainmon.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 12 rules found" in result.stdout


def test_rules_unit_tests() -> None:
    result = _promtool("test", "rules", "trainmon.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_test() -> None:
    rules = (RULES / "trainmon.rules.yml").read_text()
    tests = (RULES / "trainmon.rules.test.yml").read_text()
    alerts = [
        line.split(":", 1)[1].strip()
        for line in rules.splitlines()
        if line.strip().startswith("- alert:")
    ]
    assert len(alerts) == 6
    for alert in alerts:
        assert f"alertname: {alert}\n" in tests, alert
