"""The report's tables (docs/contract.md, Cluster report): ``jobs.tsv`` (one row per run),
``gpus.tsv`` (one row per run and GPU) and ``summary.tsv`` (totals per host, user and GPU model),
from the run folders' figures.

Either source (the run folders here, a Prometheus server in ``from_prometheus``) states
the facts of each job as an inputs frame (``INPUT_COLUMNS``); ``job_table`` derives every
column of jobs.tsv from it, the same way for both.

A run of several splits gets the mean over its splits weighted by their Training time
for means and shares, the maximum for peaks, the sum for energy and dropped records. A
job's GPU utilization is the mean over its GPUs, its power and energy the sums over them,
its memory peaks the largest of any GPU.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from sidecar.model.goodput import CAUSES
from sidecar.report.figures import Figures
from sidecar.report.read import RunFolder
from sidecar.report.straggler_columns import STRAGGLER_COLUMNS, straggler_frame

RUN_COLUMNS = ["run_id", "folder", "host", "user"]  # first in jobs.tsv and gpus.tsv
JOB_TEXT_COLUMNS = ["slurm_job_id", "command", "start", "end", "status", "cause"]
# What a job says of itself (run.json, or a series' labels), then its wall time
META_COLUMNS = [*RUN_COLUMNS, *JOB_TEXT_COLUMNS, "wall (s)"]
# A GPU's figures, in gpus.tsv per GPU and in jobs.tsv for the job's GPUs together
GPU_FIGURE_COLUMNS = [
    "GPU utilization mean (%)",
    "GPU memory peak (MB)",
    "GPU memory peak (%)",
    "energy (kWh)",
    "power mean (W)",
]
JOB_COLUMNS = [
    *RUN_COLUMNS,
    *JOB_TEXT_COLUMNS,
    "wall (s)",
    "GPUs",
    "GPU model",
    "GPU-hours",
    *GPU_FIGURE_COLUMNS,
    "train throughput (samples/s)",
    "val throughput (samples/s)",
    "data loading share (%)",
    "CPU mean (%)",
    "memory peak (MB)",
    "records dropped",
    "goodput (%)",
    *(f"badput {cause} (s)" for cause in CAUSES),
    *STRAGGLER_COLUMNS,
    "flags",
]
GPU_COLUMNS = [*RUN_COLUMNS, "gpu", "uuid", "GPU model", *GPU_FIGURE_COLUMNS, "flags"]
# The facts of a job either source states, from which ``job_table`` derives JOB_COLUMNS:
# the GPU-hours, the energy in kWh, the goodput share and the flags are derived there
INPUT_COLUMNS = [
    *META_COLUMNS,
    "GPUs",
    "GPU model",
    "GPU utilization mean (%)",
    "GPU memory peak (MB)",
    "GPU memory peak (%)",
    "energy (J)",
    "power mean (W)",
    "train throughput (samples/s)",
    "val throughput (samples/s)",
    "data loading share (%)",
    "CPU mean (%)",
    "memory peak (MB)",
    "records dropped",
    "goodput wall (s)",  # the goodput account's wall time: its parts add up to it
    "productive (s)",
    *(f"badput {cause} (s)" for cause in CAUSES),
    *STRAGGLER_COLUMNS,
]
TEXT_COLUMNS = frozenset(
    {
        *RUN_COLUMNS,
        *JOB_TEXT_COLUMNS,
        "uuid",
        "GPU model",
        "flags",
        "straggler rank",
        "straggler host",
        "straggler phase",
        "straggler throttle reasons",
    }
)
INT_COLUMNS = frozenset({"GPUs", "records dropped", "gpu"})
FLAGS = ("idle-gpu", "input-bound", "memory-pressure", "failed", "incomplete")
SUMMARY_GROUPS = (("host", "host"), ("user", "user"), ("GPU model", "GPU model"))
IDLE_GPU_PCT = 10.0
INPUT_BOUND_PCT = 30.0
MEMORY_PRESSURE_PCT = 90.0
J_PER_KWH = 3.6e6
NO_NAME = "(none)"  # summary.tsv's name for jobs without a GPU model (or host, user)


def _text(value: object) -> str:
    """A TSV cell: commands as a shell line; tabs and newlines made spaces."""
    if value is None:
        return ""
    text = shlex.join(value) if isinstance(value, list) else str(value)
    return text.replace("\t", " ").replace("\n", " ").replace("\r", " ")


def _number(value: object) -> float:
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else np.nan
    )


def typed(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``frame``'s ``columns`` in their types (text, integer, float), also when it has no
    row (pandas makes empty columns of type object)."""
    return pd.DataFrame(
        {
            c: frame[c].astype(object)
            if c in TEXT_COLUMNS
            else frame[c].astype("int64")
            if c in INT_COLUMNS
            else frame[c].astype("float64")
            for c in columns
        }
    )


def _weighted(
    frame: pd.DataFrame, by: str | list[str], weight: str, columns: list[str]
) -> pd.DataFrame:
    """Per ``by``: NaN-aware means of ``columns`` weighted by ``weight`` (NaN where no
    weight is left); a group's one value where it has one, exactly."""
    keys = [frame[b] for b in ([by] if isinstance(by, str) else by)]
    values = frame[columns]
    w = values.notna().mul(frame[weight], axis=0)
    num = values.fillna(0.0).mul(w).groupby(keys).sum()
    den = w.groupby(keys).sum()
    # v·w/w can be one ulp off v: a job of one split shows its stated figure unchanged
    single = values.notna().groupby(keys).sum() == 1
    return (num / den).where(den > 0).mask(single & (den > 0), values.groupby(keys).max())


def names(frame: pd.DataFrame) -> pd.Series:
    """How the page and report.md name each job: its folder, else (a report from
    Prometheus) its run id."""
    folder = frame["folder"].fillna("")
    return folder.where(folder != "", frame["run_id"])


def flags(frame: pd.DataFrame) -> pd.Series:
    """The ``flags`` cell of each row of a jobs frame (comma-separated, '' for none)."""
    conditions = {
        "idle-gpu": frame["GPU utilization mean (%)"] < IDLE_GPU_PCT,
        "input-bound": frame["data loading share (%)"] > INPUT_BOUND_PCT,
        "memory-pressure": frame["GPU memory peak (%)"] > MEMORY_PRESSURE_PCT,
        "failed": frame["status"] == "failed",
        "incomplete": frame["status"] == "incomplete",
    }
    cells = pd.Series("", index=frame.index, dtype=object)
    for name in FLAGS:
        cells = cells.where(~conditions[name], cells + ("," + name))
    return cells.str.lstrip(",")


def idle_gpu_hours(frame: pd.DataFrame) -> pd.Series:
    """Per job: GPU-hours × (1 − GPU utilization mean / 100), the GPU time held and left
    idle, in hours; 0 without GPUs, NaN where the GPUs' utilization is unknown."""
    busy = frame["GPU utilization mean (%)"].clip(0.0, 100.0) / 100.0
    return (frame["GPU-hours"] * (1.0 - busy)).where(frame["GPUs"] > 0, 0.0)


def most_wasteful_first(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (a jobs frame) with the most idle GPU-hours first, then the most flags,
    then the most GPU-hours; jobs whose GPUs' utilization is unknown after the others."""
    flag_count = frame["flags"].fillna("").str.count(",") + (frame["flags"].fillna("") != "")
    keyed = frame.assign(_idle=idle_gpu_hours(frame), _flags=flag_count)
    return keyed.sort_values(
        ["_idle", "_flags", "GPU-hours"], ascending=False, kind="stable", na_position="last"
    ).drop(columns=["_idle", "_flags"])


def job_table(inputs: pd.DataFrame) -> pd.DataFrame:
    """JOB_COLUMNS of each job, derived from its INPUT_COLUMNS (``inputs``, one row per
    job, from either source): GPU-hours (GPUs × wall time; 0 without GPUs), the energy
    in kWh, the goodput share (productive over the account's wall time; NaN unknown) and
    the flags; the other columns as stated."""
    jobs = inputs.copy()
    jobs["GPU-hours"] = (jobs["GPUs"] * jobs["wall (s)"] / 3600.0).where(jobs["GPUs"] > 0, 0.0)
    jobs["energy (kWh)"] = jobs["energy (J)"] / J_PER_KWH
    wall_s = jobs["goodput wall (s)"]
    jobs["goodput (%)"] = (jobs["productive (s)"] / wall_s * 100.0).where(wall_s > 0)
    jobs["flags"] = flags(jobs)
    return typed(jobs, JOB_COLUMNS)


def _goodput(runs: Sequence[RunFolder]) -> dict[str, list[float]]:
    """The goodput inputs from each run.json's ``goodput`` (the splits' means added)."""
    entries: list[dict[str, Any]] = []
    for run in runs:
        entry = run.meta.get("goodput")
        entries.append(entry if isinstance(entry, dict) else {})
    return {
        "goodput wall (s)": [_number(e.get("wall_s")) for e in entries],
        "productive (s)": [_number(e.get("productive_s")) for e in entries],
        **{
            f"badput {cause} (s)": [_number((e.get("badput_s") or {}).get(cause)) for e in entries]
            for cause in CAUSES
        },
    }


def hosts(meta: dict[str, Any]) -> list[str]:
    """The hosts of a run, sorted: those of every split's ranks (``splits.<k>.hosts``, every
    node of a job on several nodes), else run.json's ``host``."""
    found = {
        str(host)
        for entry in (meta.get("splits") or {}).values()
        if isinstance(entry, dict) and isinstance(entry.get("hosts"), dict)
        for host in entry["hosts"]
    }
    return sorted(found) or ([str(meta["host"])] if meta.get("host") else [])


def _meta_frame(runs: Sequence[RunFolder]) -> pd.DataFrame:
    rows = []
    for run in runs:
        meta = run.meta
        start, end = _number(meta.get("start_unix")), _number(meta.get("end_unix"))
        rows.append(
            {
                "run_id": _text(meta.get("run_id")),
                "folder": str(run.path),
                "host": ",".join(hosts(meta)),
                "user": _text(meta.get("user")),
                "slurm_job_id": _text(meta.get("job_id")),
                "command": _text(meta.get("command")),
                "start": _text(meta.get("start")),
                "end": _text(meta.get("end")),
                "status": _text(meta.get("status")),
                "cause": _text(meta.get("cause")),
                "wall (s)": end - start,
                "announced": {
                    g.get("uuid"): g.get("name")
                    for g in meta.get("gpus") or []
                    if isinstance(g, dict)
                },
            }
        )
    return pd.DataFrame(rows, columns=[*META_COLUMNS, "announced"])


def _split_weights(runs: Sequence[RunFolder]) -> pd.DataFrame:
    """Run number and weight (Training time; 1 each when a run's add up to 0) per split."""
    run = np.repeat(np.arange(len(runs)), [len(r.splits) for r in runs])
    weight = pd.Series([f.training_s for r in runs for f in r.splits], dtype="float64")
    total = weight.groupby(run).transform("sum")
    return pd.DataFrame({"run": run, "weight": weight.where(total > 0, 1.0)})


def _per_gpu(figures: Figures, splits: pd.DataFrame) -> pd.DataFrame:
    """One row per run and GPU UUID, its splits combined."""
    gpus = figures.gpus.join(splits, on="split")
    gpus["peak (%)"] = gpus["memory peak (MB)"] / gpus["memory total (MB)"] * 100.0
    means = _weighted(gpus, ["run", "uuid"], "weight", ["utilization mean (%)", "power mean (W)"])
    grouped = gpus.groupby(["run", "uuid"], sort=True)
    out = grouped.agg(
        gpu=("gpu", "last"),
        model=("model", "last"),
        peak_mib=("memory peak (MB)", "max"),
        peak_pct=("peak (%)", "max"),
        energy_j=("energy (J)", lambda s: s.sum(min_count=1)),
    )
    return out.join(means).reset_index()


def tables(runs: Sequence[RunFolder], figures: Figures) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``jobs`` (JOB_COLUMNS) and ``gpus`` (GPU_COLUMNS) frames of ``runs``; ``figures`` has
    the splits of every run in order (``run.splits`` of runs[0], then of runs[1], ...)."""
    inputs, gpus = _inputs(runs, figures)
    per_gpu = gpus.join(inputs[RUN_COLUMNS], on="run")
    per_gpu = per_gpu.rename(
        columns={
            "model": "GPU model",
            "peak_mib": "GPU memory peak (MB)",
            "peak_pct": "GPU memory peak (%)",
            "utilization mean (%)": "GPU utilization mean (%)",
        }
    )
    per_gpu["energy (kWh)"] = per_gpu["energy_j"] / J_PER_KWH
    per_gpu["status"] = ""  # a GPU is not failed or incomplete: its job is
    per_gpu["data loading share (%)"] = np.nan
    per_gpu["flags"] = flags(per_gpu)
    return job_table(inputs), typed(per_gpu, GPU_COLUMNS)


def _inputs(runs: Sequence[RunFolder], figures: Figures) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The inputs frame of ``runs`` (INPUT_COLUMNS; the run folders' facts), and one row
    per run and GPU (its splits combined)."""
    jobs = _meta_frame(runs)
    splits = _split_weights(runs)
    per_split = figures.splits.join(splits)
    per_split["share"] = per_split["loading mean (s)"] / per_split["loop mean (s)"] * 100.0
    means = _weighted(
        per_split, "run", "weight", ["train throughput", "val throughput", "share", "cpu mean (%)"]
    )
    by_run = per_split.groupby("run")
    gpus = _per_gpu(figures, splits)
    job_gpu = gpus.groupby("run").agg(
        util=("utilization mean (%)", "mean"),
        peak_mib=("peak_mib", "max"),
        peak_pct=("peak_pct", "max"),
        energy_j=("energy_j", lambda s: s.sum(min_count=1)),
        power=("power mean (W)", lambda s: s.sum(min_count=1)),
    )
    sampled = gpus.groupby("run")[["uuid", "model"]].agg(list)
    names = [
        dict(zip(sampled["uuid"].get(i, []), sampled["model"].get(i, []), strict=True))
        | {k: v for k, v in jobs["announced"][i].items() if k}
        for i in range(len(runs))
    ]
    jobs["GPUs"] = [len(n) for n in names]
    jobs["GPU model"] = [", ".join(sorted({str(v) for v in n.values()})) for n in names]
    jobs["GPU utilization mean (%)"] = job_gpu["util"]
    jobs["GPU memory peak (MB)"] = job_gpu["peak_mib"]
    jobs["GPU memory peak (%)"] = job_gpu["peak_pct"]
    jobs["energy (J)"] = job_gpu["energy_j"]
    jobs["power mean (W)"] = job_gpu["power"]
    jobs["train throughput (samples/s)"] = means["train throughput"]
    jobs["val throughput (samples/s)"] = means["val throughput"]
    jobs["data loading share (%)"] = means["share"]
    jobs["CPU mean (%)"] = means["cpu mean (%)"]
    jobs["memory peak (MB)"] = by_run["memory peak (MB)"].max()
    jobs["records dropped"] = by_run["dropped"].sum().astype("int64")
    for column, values in _goodput(runs).items():
        jobs[column] = values
    jobs[STRAGGLER_COLUMNS] = straggler_frame(runs, jobs["GPUs"])
    return jobs[INPUT_COLUMNS], gpus


def summary(jobs: pd.DataFrame) -> pd.DataFrame:
    """Totals per host, per user and per GPU model: jobs, GPU-hours, energy, GPU
    utilization weighted by GPU-hours, how many jobs carry each flag, and the GPU-hours
    lost per badput cause (each job's GPUs × its seconds of that cause)."""
    frame = jobs.assign(
        **{name: jobs["flags"].str.split(",").apply(lambda f, n=name: n in f) for name in FLAGS}
    )
    lost = {
        f"GPU-hours lost {cause}": jobs["GPUs"] * jobs[f"badput {cause} (s)"] / 3600.0
        for cause in CAUSES
    }
    frame = frame.assign(**lost)
    parts = []
    for label, column in SUMMARY_GROUPS:
        grouped = frame.groupby(column, sort=True)
        part = pd.DataFrame(
            {
                "jobs": grouped.size(),
                "GPU-hours": grouped["GPU-hours"].sum(),
                "energy (kWh)": grouped["energy (kWh)"].sum(min_count=1),
            }
        )
        weighted = _weighted(
            frame.assign(w=frame["GPU-hours"].fillna(0.0)),
            column,
            "w",
            ["GPU utilization mean (%)"],
        )
        part["GPU utilization mean (%)"] = weighted["GPU utilization mean (%)"]
        for name in FLAGS:
            part[name] = grouped[name].sum().astype("int64")
        for name in lost:
            part[name] = grouped[name].sum(min_count=1)
        part.index = part.index.where(part.index != "", NO_NAME)
        part.index.name = "name"
        parts.append(part.reset_index().assign(by=label))
    out = pd.concat(parts, ignore_index=True)
    return out[["by", "name", *out.columns[1:-1]]]
