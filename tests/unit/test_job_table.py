"""jobs.tsv from the facts of each job: either source (run folders, Prometheus) states
them as an inputs frame and one function derives every column from it."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from sidecar.report import jobs


def _inputs(**facts: object) -> pd.DataFrame:
    row = dict.fromkeys(jobs.INPUT_COLUMNS, math.nan)
    row.update({c: "" for c in jobs.INPUT_COLUMNS if c in jobs.TEXT_COLUMNS})
    row.update({"GPUs": 0, "records dropped": 0, "status": "completed"})
    row.update(facts)
    return pd.DataFrame([row], columns=jobs.INPUT_COLUMNS)


def test_the_meta_columns_lead_the_jobs_table_and_the_inputs() -> None:
    count = len(jobs.META_COLUMNS)
    assert jobs.JOB_COLUMNS[:count] == jobs.INPUT_COLUMNS[:count] == jobs.META_COLUMNS
    assert jobs.META_COLUMNS[-1] == "wall (s)"
    # what is stated and what is derived make up jobs.tsv (energy stated in J)
    derived = {"GPU-hours", "energy (kWh)", "goodput (%)", "flags"}
    assert set(jobs.JOB_COLUMNS) - derived == set(jobs.INPUT_COLUMNS) - {
        "energy (J)",
        "goodput wall (s)",
        "productive (s)",
    }


def test_every_derived_column_from_the_facts() -> None:
    inputs = pd.concat(
        [
            _inputs(
                **{
                    "wall (s)": 7200.0,
                    "GPUs": 4,
                    "energy (J)": 3.6e6 * 2.5,
                    "goodput wall (s)": 100.0,
                    "productive (s)": 80.0,
                    "GPU utilization mean (%)": 5.0,
                    "data loading share (%)": 40.0,
                    "status": "failed",
                }
            ),
            _inputs(**{"wall (s)": 60.0, "goodput wall (s)": 0.0, "productive (s)": 0.0}),
        ],
        ignore_index=True,
    )
    table = jobs.job_table(inputs)
    assert list(table.columns) == jobs.JOB_COLUMNS
    first, second = table.iloc[0], table.iloc[1]
    assert first["GPU-hours"] == pytest.approx(8.0)
    assert first["energy (kWh)"] == pytest.approx(2.5)
    assert first["goodput (%)"] == pytest.approx(80.0)
    assert first["flags"] == "idle-gpu,input-bound,failed"
    # no GPU: no GPU-hours; a goodput account of no time: no share
    assert second["GPU-hours"] == 0.0 and math.isnan(second["goodput (%)"])
    assert second["flags"] == ""
