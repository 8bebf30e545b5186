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

# tool -> the Debian package that installs it
PACKAGES = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "chromium-headless-shell": "chromium-headless-shell",
    "script": "util-linux",
    "systemd-analyze": "systemd",
}


def missing(name: str) -> str | None:
    """Why the test cannot run without tool ``name`` ("needs promtool (apt-get install
    prometheus)"), or None when it is on PATH."""
    if shutil.which(name):
        return None
    return f"needs {name} (apt-get install {PACKAGES[name]})"


def require_tool(name: str) -> None:
    """Skip the calling test when tool ``name`` (a key of ``PACKAGES``) is not on PATH,
    naming it and its package; with ``TESTS_REQUIRE_TOOLS`` set (CI), fail it instead."""
    why = missing(name)
    if why is None:
        return
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{why}; {REQUIRE_ENV} is set, so every tool must be there", pytrace=False)
    pytest.skip(why)
