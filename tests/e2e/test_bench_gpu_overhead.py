"""The GPU overhead benchmark: its CPU skip path."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_overhead.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_overhead", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(load().torch.cuda.is_available(), reason="the skip path is for CPU hosts")
def test_without_cuda_it_skips_cleanly_and_writes_nothing():
    results = ROOT / "bench" / "RESULTS.md"
    before = results.read_text() if results.exists() else None
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout
    assert (results.read_text() if results.exists() else None) == before
