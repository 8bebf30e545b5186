"""The system tools some tests run (not Python packages): found on PATH, or the test is
skipped naming the tool and the Debian package that has it.

CI installs every one (``.ci/run``) and sets ``TESTS_REQUIRE_TOOLS=1``: there a missing
tool fails the test instead, so no test is skipped unseen.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "TESTS_REQUIRE_TOOLS"

# tool -> the command that installs it (Debian's packages, npm's)
INSTALL = {
    "prometheus": "apt-get install prometheus",
    "promtool": "apt-get install prometheus",
    "chromium-headless-shell": "apt-get install chromium-headless-shell",
    "script": "apt-get install util-linux",
    "systemd-analyze": "apt-get install systemd",
    "tmux": "apt-get install tmux",
    "stress-ng": "apt-get install stress-ng",
    "speedscope": "npm install -g speedscope",
}


def missing(name: str) -> str | None:
    """Why the test cannot run without tool ``name`` ("needs promtool (apt-get install
    prometheus)"), or None when it is on PATH."""
    if shutil.which(name):
        return None
    return f"needs {name} ({INSTALL[name]})"


def require_tool(name: str) -> None:
    """Skip the calling test when tool ``name`` (a key of ``INSTALL``) is not on PATH,
    naming it and how to install it; with ``TESTS_REQUIRE_TOOLS`` set (CI), fail it
    instead."""
    require(missing(name))


def require(why: str | None) -> None:
    """Skip the calling test for ``why`` (a missing tool, named; None: nothing missing);
    with ``TESTS_REQUIRE_TOOLS`` set (CI), fail it instead."""
    if why is None:
        return
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{why}; {REQUIRE_ENV} is set, so every tool must be there", pytrace=False)
    pytest.skip(why)
