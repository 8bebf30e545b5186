"""aggregate_resource_usage.csv is written beside resources.tsv on every run, without
any export and on a machine without a GPU: its CPU rows are the mean and the max of
resources.tsv's samples, in InnerEye's names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.support.helpers import REPO, env, split_dir

pytestmark = pytest.mark.e2e
JOB = REPO / "tests" / "support" / "jobs" / "export_job.py"


def test_the_file_has_the_cpu_rows_of_resources_tsv(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(JOB), "--out-dir", "maps", "--export", "", "--sleep", "0.02"],
        cwd=tmp_path,
        env=env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    logs = split_dir(tmp_path / "maps") / "logs"
    resources = pd.read_csv(logs / "resources.tsv", sep="\t")
    aggregate = pd.read_csv(logs / "aggregate_resource_usage.csv")
    assert list(aggregate.columns) == ["gpu", "metric", "value"]
    rows = {(g, m): v for g, m, v in aggregate.itertuples(index=False)}
    if not resources["gpu index"].dropna().empty:
        # with a GPU, resources.tsv lays host and GPU samples out together: the CPU rows
        # are there, their figures are checked where resources.tsv holds host rows alone
        assert ("CPU", "Load_Percent") in rows
        return
    assert set(aggregate["gpu"]) == {"CPU"}  # no GPU sampled: the CPU rows alone
    load = resources["host cpu (%)"].dropna() / (os.cpu_count() or 1)
    memory = resources["system memory used (%)"].dropna()
    assert rows[("CPU", "Load_Percent")] == pytest.approx(load.mean(), abs=0.006)
    assert rows[("CPU", "MaxLoad_Percent")] == pytest.approx(load.max(), abs=0.006)
    assert rows[("CPU", "MemUtil_Percent")] == pytest.approx(memory.mean(), abs=0.006)
    assert rows[("CPU", "MaxMemUtil_Percent")] == pytest.approx(memory.max(), abs=0.006)
