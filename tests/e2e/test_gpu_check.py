"""The GPU pass script's dry run, on a machine without a GPU: it checks the packages,
collects the GPU tests by name, runs the CPU paths of its measurements and writes its
section with every GPU part "not run", leaving bench/RESULTS.md alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_passes_and_says_every_gpu_part_was_not_run(tmp_path: Path) -> None:
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_text()
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "bench" / "gpu_check.sh"),
            "--dry-run",
            "--results",
            str(out),
            "--wheels",
            str(tmp_path / "none"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: OK (dry run" in proc.stdout
    section = out.read_text()
    assert section.startswith("# Benchmark results\n\n## GPU pass\n")
    lines = {line.split(":")[0]: line for line in section.splitlines() if line.startswith("- ")}
    for part in ("- GPU tests (", "- host cost of a phase's allocator reads", "- GPU overhead"):
        [line] = [text for key, text in lines.items() if key.startswith(part)]
        assert "not run" in line, line
    assert "GPU tests collected in 4 files" in section
    assert "fake-path figures" in section  # the fake's figure is never passed off as real
    assert results.read_text() == before


def test_without_a_gpu_the_real_pass_refuses_loudly(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--results", str(tmp_path / "RESULTS.md")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if "torch.cuda.is_available() is False" not in proc.stdout:
        pytest.skip("a GPU machine: there the real pass runs")
    assert proc.returncode == 3
    assert "FATAL: torch.cuda.is_available() is False" in proc.stderr
    assert not (tmp_path / "RESULTS.md").exists()
