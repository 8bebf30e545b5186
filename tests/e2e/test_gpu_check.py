"""The GPU pass script on a machine without a GPU: its dry run goes through every step of
the real pass (packages, the torch import, the C build, the GPU tests on both bases, the
device measurements and the benchmarks' CPU paths on the fakes), keeps every log in
--out and says what it did not run; the real pass refuses loudly without CUDA or torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def gpu_check(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_the_dry_run_goes_through_every_step_and_keeps_its_evidence(tmp_path: Path) -> None:
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_text()
    out = tmp_path / "out"
    proc = gpu_check(tmp_path, "--dry-run", "--out", str(out), "--wheels", str(tmp_path / "no"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: OK (dry run" in proc.stdout
    kept = {path.name for path in out.iterdir()}
    for name in (
        "gpu_check.log",
        "build.log",
        "gpu-tests-c.xml",
        "gpu-tests-c.log",
        "gpu-tests-pure.xml",
        "gpu-tests-pure.log",
        "drift.json",
        "probe.md",
        "memory.log",
        "overhead.log",
        "RESULTS.md",
    ):
        assert name in kept, sorted(kept)
    section = (out / "RESULTS.md").read_text()
    assert section.startswith("# Benchmark results\n\n## GPU pass\n")
    lines = {line.split(":")[0]: line for line in section.splitlines() if line.startswith("- ")}
    for part in ("- GPU tests (", "- host cost of a phase's allocator", "- GPU overhead"):
        [line] = [text for key, text in lines.items() if key.startswith(part)]
        assert "not run" in line, line
    assert "C markers: built" in section  # a C compiler is here: both bases collected
    assert "c: not run (dry run): " in section and "pure: not run (dry run): " in section
    assert "GPU tests collected in 4 files" in section
    assert "fake-path figures" in section  # the fake's figure is never passed off as real
    assert "the fakes' figures, not a GPU's" in section
    assert "- not run: every GPU test (collected only)" in section
    # the fake GPU timer drifts by 50 ppm: the drift step finds it
    assert abs(json.loads((out / "drift.json").read_text())["drift_ppm"] - 50) < 15
    assert "| nvmlDeviceGetUtilizationRates |" in section
    assert results.read_text() == before


def test_without_a_gpu_the_real_pass_refuses_loudly(tmp_path: Path) -> None:
    proc = gpu_check(tmp_path, "--out", str(tmp_path / "out"))
    if "torch.cuda.is_available() is False" not in proc.stdout:
        pytest.skip("a GPU machine: there the real pass runs")
    assert proc.returncode == 3
    assert "FATAL: torch.cuda.is_available() is False" in proc.stdout
    assert not (tmp_path / "out" / "RESULTS.md").exists()


def test_without_torch_the_pass_says_so_in_one_line(tmp_path: Path) -> None:
    # a torch that is found but does not import (find_spec would say it is there)
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open')\n")
    proc = gpu_check(tmp_path, "--out", str(tmp_path / "out"), PYTHONPATH=str(shadow.parent))
    assert proc.returncode == 3, proc.stdout[-2000:]
    [fatal] = [line for line in proc.stdout.splitlines() if "FATAL" in line]
    assert "no torch: import torch failed: ImportError: libcudart.so.12" in fatal
    assert "Traceback" not in proc.stdout
