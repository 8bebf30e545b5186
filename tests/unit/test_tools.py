"""The one helper for tests that run a system tool: skip naming it, or fail under CI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tools import REQUIRE_ENV, require_tool


def test_a_missing_tool_skips_naming_it_and_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(
        pytest.skip.Exception, match=r"needs promtool \(apt-get install prometheus\)"
    ):
        require_tool("promtool")


def test_under_ci_a_missing_tool_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"needs script \(apt-get install util-linux\)"):
        require_tool("script")


def test_a_tool_on_the_path_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "chromium-headless-shell"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(REQUIRE_ENV, "1")
    require_tool("chromium-headless-shell")  # neither skips nor fails
