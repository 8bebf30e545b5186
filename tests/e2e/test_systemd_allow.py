"""The drop-in that lets the node daemon write in the users' own folders
(``systemd/sidecar.service.d/allow.conf``, docs/node-daemon.md): with the unit, the real
``systemd-analyze verify`` says nothing; its ``ReadWritePaths=`` opens exactly the roots
its ``--allow`` options name, and ``ProtectHome=`` is relaxed to read-only, no further.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from tests.e2e.test_systemd_units import UNITS, _installed_copy
from tests.support.tools import require_tool

DROP_IN = UNITS / "sidecar.service.d" / "allow.conf"


def _settings() -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in DROP_IN.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            values.setdefault(key, []).extend(shlex.split(value))
    return values


def test_read_write_paths_follow_the_allowed_roots() -> None:
    settings = _settings()
    allow = next(v for v in settings["Environment"] if v.startswith("SIDECAR_ALLOW="))
    words = allow.split("=", 1)[1].split()
    roots = [words[i + 1] for i, word in enumerate(words) if word == "--allow"]
    assert roots and len(roots) * 2 == len(words)
    assert [p.lstrip("-") for p in settings["ReadWritePaths"]] == roots
    assert settings["ProtectHome"] == ["read-only"]
    assert "$SIDECAR_ALLOW" in (UNITS / "sidecar.service").read_text()


def test_the_unit_with_the_drop_in_verifies(tmp_path: Path) -> None:
    require_tool("systemd-analyze")
    unit = _installed_copy(tmp_path, "sidecar.service")
    (tmp_path / "sidecar.service.d").mkdir()
    shutil.copy(DROP_IN, tmp_path / "sidecar.service.d" / "allow.conf")
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr
