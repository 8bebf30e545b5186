"""``sidecar report --prometheus URL --since DURATION``: the report built from the series a
Prometheus server holds (docs/report.md, docs/metrics.md), through its HTTP API
(``/api/v1/query``).

One row per job: the ``run`` labels (one per sidecar: each exports its first process's run
id) of one run folder and split (``trainmon_run_info``) are one job, served by several
nodes; a series without that info is a job of its own. The job's ``run_id`` is the one of
the sidecar serving its lowest rank (run.json's). What adds up is summed over its nodes (GPUs,
energy, power, CPU seconds, dropped records), the memory peak is its largest node's, the
status the worst (failed > incomplete > ended > running > completed), the start the
earliest, the end the latest (none while a node runs); ``host`` lists the hosts. The
per-iteration figures are rank 0's, as summary.log's. The series carry the streaming
figures over every post-warmup measurement, so:

* throughput = samples of the measured iterations / their summed Training loop time
  (``trainmon_samples_total / trainmon_phase_duration_seconds_sum{phase="train_loop"}``),
  the summary.log figure whenever the run stored all its measurements (below the cap);
* data loading share = mean Training data loading / mean Training loop, the same way;
* start, end and status: the run's own (``trainmon_run_start_timestamp_seconds``,
  ``trainmon_run_end_timestamp_seconds``, ``trainmon_run_status``) as the window's last
  scrape saw them; wall = end − start once ended, else the Training time so far;
  CPU mean = CPU seconds / wall;
* GPU figures: utilization and power are means over the scrapes in the window, memory
  peak the largest scrape, energy the counter's last value (a GPU two nodes exported
  counts once, as in the report from folders); GPU memory % is left empty (the total
  memory is not exported).

A run whose series stopped while it was ``running`` (its sidecar stopped exporting without
an end, e.g. killed) is ``ended`` at its last scrape; ``cause`` and ``command`` are not
exported and stay empty.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import numpy as np
import pandas as pd

from sidecar.model.goodput import CAUSES
from sidecar.model.units import BYTES_PER_MIB
from sidecar.report import jobs
from sidecar.report.build import PHASE_MEANS, Report, damaged_frame
from sidecar.report.figures import PLOT_POINTS, READ_PHASES
from sidecar.report.straggler_columns import STRAGGLER_COLUMNS

TIMEOUT_S = 30.0
RUN = ["run", "user", "host", "slurm_job_id"]
_RUN_FIGURES = ["folder", "job", "rank", "ranks", "training_s", "start_unix", "end_unix", "status"]
# a job's status is the worst of its nodes' runs ("ended": stopped exporting while running)
_STATUS_WORST_LAST = ("completed", "running", "ended", "incomplete", "failed")
_STATUS_RANK = {status: worst for worst, status in enumerate(_STATUS_WORST_LAST)}
_ONCE_PER_GPU = {
    "host": "first",
    "gpu": "first",
    "model": "first",
    "GPU utilization mean (%)": "mean",
    "GPU memory peak (MB)": "max",
    "power mean (W)": "mean",
    "energy (J)": "max",
}
_PHASE = "trainmon_phase_duration_seconds"
# The phases read (the report's names) -> their ``phase`` label; PHASE_MEANS' order.
_KEYS = {name: p.metric for name, p in READ_PHASES.items()}


class PrometheusError(Exception):
    """The server could not be asked or answered with an error; the message says which."""


def query(url: str, promql: str) -> list[dict[str, Any]]:
    """The ``result`` list of an instant query; raises PrometheusError."""
    address = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(address, timeout=TIMEOUT_S) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            detail = json.load(exc).get("error", exc.reason)
        except ValueError:
            detail = exc.reason
        raise PrometheusError(f"{url} refused {promql!r}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PrometheusError(f"cannot ask {url}: {getattr(exc, 'reason', exc)}") from None
    if body.get("status") != "success":
        raise PrometheusError(f"{url}: {body.get('error', 'query failed')}")
    return body["data"]["result"]


def _values(url: str, promql: str, keys: tuple[str, ...] = ("run",)) -> pd.Series:
    """The value of each result of ``promql``, indexed by its ``keys`` labels."""
    results = query(url, promql)
    index = pd.MultiIndex.from_tuples(
        [tuple(r["metric"].get(k, "") for k in keys) for r in results], names=list(keys)
    )
    if len(keys) == 1:
        index = index.get_level_values(0)
    return pd.Series([float(r["value"][1]) for r in results], index=index, dtype="float64")


def _phase(url: str, since: str, phase: str, part: str) -> pd.Series:
    return _values(url, f'last_over_time({_PHASE}_{part}{{phase="{phase}",rank="0"}}[{since}])')


def _runs(url: str, since: str) -> pd.DataFrame:
    """One row per run (one sidecar's part of a split): labels, its lowest rank, Training
    time, start, end (NaN while it runs), status, and the job it belongs to.

    The status and times are the run's own (``trainmon_run_status``, ``..._timestamp_
    seconds``) as the last scrape in the window saw them. A run whose series stopped while
    it said ``running`` (its sidecar stopped exporting, say it was killed) is ``ended`` at
    its last scrape."""
    raw = query(url, f'{_PHASE}_sum{{phase="training"}}[{since}]')
    present = {r["metric"].get("run") for r in query(url, f'{_PHASE}_sum{{phase="training"}}')}
    stated = {
        r["metric"].get("run"): r["metric"].get("status", "")
        for r in query(url, f"last_over_time(trainmon_run_status[{since}]) == 1")
    }
    starts, ends = (
        _values(url, f"last_over_time(trainmon_run_{which}_timestamp_seconds[{since}])")
        for which in ("start", "end")
    )
    folders = {
        r["metric"].get("run"): (r["metric"].get("folder", ""), r["metric"].get("split", ""))
        for r in query(url, f"last_over_time(trainmon_run_info[{since}])")
    }
    rows = []
    for series in raw:  # one per rank
        labels, values = series["metric"], series["values"]
        run = labels.get("run", "")
        last_unix, training_s = float(values[-1][0]), float(values[-1][1])
        status = stated.get(run, "running")
        end_unix = float(ends.get(run, math.nan))
        if status == "running" and run not in present:
            status, end_unix = "ended", last_unix
        folder, split = folders.get(run, ("", ""))
        rows.append(
            {
                **{k: labels.get(k, "") for k in RUN},
                "folder": folder,
                # the runs of one folder and split are one job; without the info, the run
                "job": f"{folder}\0{split}" if folder else run,
                "rank": int(labels.get("rank") or 0),
                "ranks": int(labels.get("rank") or 0),
                "training_s": training_s,
                "start_unix": float(starts.get(run, last_unix - training_s)),
                "end_unix": end_unix,
                "status": status,
            }
        )
    frame = pd.DataFrame(rows, columns=[*RUN, *_RUN_FIGURES])
    once = dict.fromkeys([*RUN[1:], "folder", "job", "status"], "first")
    return (
        frame.groupby("run", sort=False)
        .agg(
            once
            | {"rank": "min", "ranks": frozenset}
            | {"training_s": "max", "start_unix": "min", "end_unix": "max"}
        )
        .reset_index()
    )


def _current(runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` less the superseded ones: a run that stopped being exported while running
    whose ranks another run of its job exports. A sidecar labels a split with its lowest
    rank's run id, so ranks that said hello before a lower one were first exported under
    another label, then under the new one: the same figures twice."""
    superseded = []
    for _, group in runs.groupby("job", sort=False):
        for index, row in group.iterrows():
            others = group["ranks"].drop(index)
            covered = frozenset().union(*others) if len(others) else frozenset()
            if row["status"] == "ended" and row["ranks"] <= covered:
                superseded.append(index)
    return runs.drop(index=superseded)


def _jobs(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per job from its runs: the run id, user and Slurm job id of the run with
    the lowest rank, the hosts listed, the longest Training time, the earliest start, the
    latest end (NaN while one runs), the worst status."""
    runs = runs.assign(
        _worst=runs["status"].map(_STATUS_RANK).fillna(0),
        _open=runs["end_unix"].isna(),
    ).sort_values(["rank", "start_unix"], kind="stable")
    grouped = runs.groupby("job", sort=False)
    jobs_frame = grouped.agg(
        run=("run", "first"),
        user=("user", "first"),
        slurm_job_id=("slurm_job_id", "first"),
        folder=("folder", "first"),
        host=("host", lambda h: ",".join(sorted({x for x in h if x}))),
        training_s=("training_s", "max"),
        start_unix=("start_unix", "min"),
        end_unix=("end_unix", "max"),
        _open=("_open", "any"),
        _worst=("_worst", "max"),
    )
    jobs_frame.loc[jobs_frame["_open"], "end_unix"] = math.nan
    jobs_frame["status"] = jobs_frame["_worst"].map(dict(enumerate(_STATUS_WORST_LAST)))
    jobs_frame = jobs_frame.drop(columns=["_open", "_worst"])
    return jobs_frame.sort_values("start_unix", kind="stable").reset_index()


def _iso(unix: float) -> str:
    if math.isnan(unix):
        return ""
    return pd.Timestamp(unix, unit="s", tz="UTC").isoformat(timespec="seconds")


def _gpus(url: str, since: str, job_of: pd.Series) -> pd.DataFrame:
    """One row per job and GPU: the job's run id (``job_of``: run label -> it), index,
    model and the GPU figures. A GPU two of the job's nodes exported counts once: its
    largest energy and peak, its mean utilization and power (as from folders)."""
    selector = f"{{run!=''}}[{since}]"
    keys = ("run", "uuid", "gpu", "model", "host")
    figures = {
        "GPU utilization mean (%)": _values(
            url, f"avg_over_time(trainmon_gpu_utilization_ratio{selector}) * 100", keys
        ),
        "GPU memory peak (MB)": _values(
            url, f"max_over_time(trainmon_gpu_memory_used_bytes{selector}) / {BYTES_PER_MIB}", keys
        ),
        "power mean (W)": _values(url, f"avg_over_time(trainmon_gpu_power_watts{selector})", keys),
        "energy (J)": _values(
            url, f"last_over_time(trainmon_gpu_energy_joules_total{selector})", keys
        ),
    }
    frame = pd.DataFrame(figures)
    frame.index.names = list(keys)
    frame = frame.reset_index()
    frame["gpu"] = pd.to_numeric(frame["gpu"])
    frame["run"] = frame["run"].map(job_of)
    once = frame.dropna(subset=["run"]).groupby(["run", "uuid"], sort=False).agg(_ONCE_PER_GPU)
    return once.reset_index().assign(**{"GPU memory peak (%)": np.nan})


def _per_job(values: pd.Series, job_of: pd.Series, how: str, run: pd.Series) -> np.ndarray:
    """``values`` (by run label) combined (``how``: sum, max) over each job's runs, in the
    order of ``run`` (the jobs' run ids); NaN for a job with none."""
    return values.groupby(job_of.reindex(values.index).to_numpy()).agg(how).reindex(run).to_numpy()


def _rank_mean(url: str, promql: str, job_of: pd.Series, run: pd.Series) -> list[float]:
    """Per job: the mean over its ranks of ``promql``'s value (labels run, split, rank),
    added up over its splits."""
    values = _values(url, promql, ("run", "split", "rank")).reset_index(name="value")
    values["job"] = values["run"].map(job_of)
    per_rank = values.groupby(["job", "split", "rank"])["value"].mean()
    per_split = per_rank.groupby(level=["job", "split"]).mean()
    return per_split.groupby(level="job").sum().reindex(run).tolist()


def _samples(url: str, since: str, runs: pd.Series) -> pd.DataFrame:
    """GPU utilization scrapes per job (by position in ``runs``) for the page's plots."""
    position = {run: i for i, run in enumerate(runs)}
    parts = []
    for series in query(url, f"trainmon_gpu_utilization_ratio{{run!=''}}[{since}]"):
        labels = series["metric"]
        if labels.get("run") not in position:
            continue
        values = np.asarray(series["values"], dtype="float64")
        values = values[:: max(1, math.ceil(len(values) / PLOT_POINTS))]
        parts.append(
            pd.DataFrame(
                {
                    "job": position[labels["run"]],
                    "gpu": int(labels["gpu"]),
                    "time (s)": values[:, 0] - values[0, 0],
                    "utilization (%)": values[:, 1] * 100,
                }
            )
        )
    columns = ["job", "gpu", "time (s)", "utilization (%)"]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


def from_prometheus(url: str, since: str) -> Report:
    """The report of every job with series in the last ``since`` (a Prometheus duration
    such as ``6h``, checked by the caller); raises PrometheusError when the server cannot
    answer or refuses a query."""
    runs = _current(_runs(url, since))
    found = _jobs(runs)
    run = found["run"]  # each job's run id: its lowest rank's run
    job_of = runs.set_index("run")["job"].map(found.set_index("job")["run"])
    sums = {
        name: _phase(url, since, phase, "sum").reindex(run).to_numpy()
        for name, phase in _KEYS.items()
    }
    counts = {
        name: _phase(url, since, phase, "count").reindex(run).to_numpy()
        for name, phase in _KEYS.items()
    }
    with np.errstate(invalid="ignore", divide="ignore"):
        means = {
            name: np.where(counts[name] > 0, sums[name] / counts[name], np.nan) for name in _KEYS
        }
    samples = {
        loop: _values(
            url, f'last_over_time(trainmon_samples_total{{loop="{loop}",rank="0"}}[{since}])'
        )
        .reindex(run)
        .to_numpy()
        for loop in ("train", "val")
    }
    val_loop = _phase(url, since, "val_loop", "sum").reindex(run).to_numpy()
    # every node's: CPU seconds and dropped records add up, the memory peak is the largest
    last = {
        name: _per_job(_values(url, f"{fn}({metric}[{since}])"), job_of, how, run)
        for name, fn, metric, how in (
            ("cpu", "last_over_time", "trainmon_job_cpu_seconds_total", "sum"),
            ("rss", "max_over_time", "trainmon_job_memory_rss_bytes", "max"),
            ("dropped", "last_over_time", 'trainmon_records_total{outcome="dropped"}', "sum"),
        )
    }
    gpus = _gpus(url, since, job_of)
    # as run.json's: end − start once the job ended; the Training time so far before
    wall = np.where(
        found["end_unix"].notna(), found["end_unix"] - found["start_unix"], found["training_s"]
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        table = pd.DataFrame(
            {
                "run_id": run,
                "folder": found["folder"],
                "host": found["host"],
                "user": found["user"],
                "slurm_job_id": found["slurm_job_id"],
                "command": "",
                "start": [_iso(t) for t in found["start_unix"]],
                "end": [_iso(t) for t in found["end_unix"]],
                "status": found["status"],
                "cause": "",
                "wall (s)": wall,
                "train throughput (samples/s)": samples["train"] / sums["loop"],
                "val throughput (samples/s)": samples["val"] / val_loop,
                "data loading share (%)": means["loading"] / means["loop"] * 100.0,
                "CPU mean (%)": last["cpu"] / wall * 100.0,
                "memory peak (MB)": last["rss"] / BYTES_PER_MIB,
                "records dropped": np.nan_to_num(last["dropped"]).astype("int64"),
                # the straggler is in the run folders, not exported per job
                **dict.fromkeys(STRAGGLER_COLUMNS, np.nan),
                **dict.fromkeys(["straggler rank", "straggler host", "straggler phase"], ""),
                "straggler throttle reasons": "",
            }
        )
    per_job = (
        gpus.groupby("run")
        .agg(
            n=("uuid", "nunique"),
            model=("model", lambda m: ", ".join(sorted(set(m)))),
            util=("GPU utilization mean (%)", "mean"),
            peak=("GPU memory peak (MB)", "max"),
            energy=("energy (J)", lambda s: s.sum(min_count=1)),
            power=("power mean (W)", lambda s: s.sum(min_count=1)),
        )
        .reindex(run)
    )
    table["GPUs"] = per_job["n"].fillna(0).astype("int64").to_numpy()
    table["GPU model"] = per_job["model"].fillna("").to_numpy()
    table["GPU utilization mean (%)"] = per_job["util"].to_numpy()
    table["GPU memory peak (MB)"] = per_job["peak"].to_numpy()
    table["GPU memory peak (%)"] = np.nan
    table["energy (J)"] = per_job["energy"].to_numpy()
    table["power mean (W)"] = per_job["power"].to_numpy()
    # the goodput account of a split is the mean over its ranks, on whichever node
    parts = {
        part: _rank_mean(
            url,
            f'last_over_time(trainmon_goodput_seconds{{part="{part}"}}[{since}])',
            job_of,
            run,
        )
        for part in ("productive", *CAUSES)
    }
    table["goodput wall (s)"] = _rank_mean(
        url, f"last_over_time(trainmon_goodput_wall_seconds[{since}])", job_of, run
    )
    table["productive (s)"] = parts["productive"]
    for cause in CAUSES:
        table[f"badput {cause} (s)"] = parts[cause]
    job_table = jobs.job_table(table[jobs.INPUT_COLUMNS])

    per_gpu = (
        gpus.drop(columns="host")
        .merge(job_table[["run_id", "folder", "host", "user"]], left_on="run", right_on="run_id")
        .rename(columns={"model": "GPU model"})
    )
    per_gpu["energy (kWh)"] = per_gpu["energy (J)"] / jobs.J_PER_KWH
    per_gpu["status"] = ""
    per_gpu["data loading share (%)"] = np.nan
    per_gpu["flags"] = jobs.flags(per_gpu)
    phase_means = pd.DataFrame(
        {column: means[name] for column, name in zip(PHASE_MEANS, _KEYS, strict=True)}
    )
    return Report(
        job_table,
        jobs.typed(per_gpu, jobs.GPU_COLUMNS),
        jobs.summary(job_table),
        damaged_frame([]),
        phase_means,
        _samples(url, since, run),
    )
