"""``sidecar report --job ID|FOLDER``: one job's efficiency, for the user who ran it, in an
80-column terminal (or as JSON): the header, bars for GPU utilization, GPU memory, CPU and
host memory, the goodput split, the phase shares, the straggler, and one line of advice
per finding.

Every figure comes from the job's files, through the same code as ``jobs.tsv``
(``sidecar.report.build``), plus ``run.json``'s goodput and DataLoader settings and
``resources.tsv``'s system memory; docs/report.md says where each comes from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from sidecar.model.goodput import BADPUT, CAUSES
from sidecar.report import build, jobs, read
from sidecar.report.figures import STEP_PARTS
from sidecar.sinks import layout

WIDTH = 80
BAR = 30  # characters of a bar
LABEL = 18
BADPUT_ADVICE_SHARE = 10.0  # a cause over this share of the wall time gets a line
STRAGGLER_ADVICE_SHARE = 5.0
# The goodput bars' labels: productive time, then each cause's short name.
SHORT = {"productive": "productive"} | {cause.id: cause.short for cause in BADPUT}
ADVICE = {cause.id: cause.advice for cause in BADPUT if cause.advice is not None}


class JobNotFound(LookupError):
    """No run folder matches the job asked for."""


def find_job(job: str, paths: Iterable[Path]) -> Path:
    """The run folder of ``job``: a folder holding run.json, else the run folder under
    ``paths`` whose run.json names Slurm job ``job`` (the latest started). Raises
    JobNotFound."""
    folder = Path(job)
    if (folder / layout.RUN_FILE).is_file():
        return folder
    found: list[tuple[float, Path]] = []
    for candidate in read.find_run_folders(paths):
        try:
            meta = json.loads((candidate / layout.RUN_FILE).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and str(meta.get("job_id")) == job:
            start = meta.get("start_unix")
            found.append((start if isinstance(start, (int, float)) else 0.0, candidate))
    if not found:
        raise JobNotFound(f"no run folder of job {job} under {', '.join(map(str, paths)) or '.'}")
    return max(found)[1]


def _value(value: Any) -> float | None:
    """A float, None for NaN or a missing value."""
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not math.isnan(float(value))
    ):
        return float(value)
    return None


def _system_memory_pct(folder: Path, meta: dict[str, Any]) -> float | None:
    """The largest ``system memory used (%)`` of the job's splits' resources tables, every
    node's (its fullest host)."""
    peaks = []
    for split in sorted(meta.get("splits") or {}):
        logs = folder / "training" / f"split-{split}" / "logs"
        for path in [logs / layout.RESOURCES_FILE, *logs.glob(layout.node_resources_file("*"))]:
            try:
                column = pd.read_csv(path, sep="\t", usecols=["system memory used (%)"])
            except (OSError, ValueError):
                continue
            peaks.append(column["system memory used (%)"].max())
    return _value(max(peaks)) if peaks else None


def figures(folder: Path) -> dict[str, Any]:
    """Every figure of the job report of run folder ``folder`` (what ``--json`` prints).
    Raises read.Damaged for a folder the report cannot read."""
    report = build.from_folders([folder], lambda done, total: None)
    if report.jobs.empty:
        reason = report.damaged["reason"].iloc[0] if len(report.damaged) else "unreadable"
        raise read.Damaged(reason)
    row = report.jobs.iloc[0]
    meta = json.loads((folder / layout.RUN_FILE).read_bytes())
    splits = meta.get("splits") or {}
    phase_means = report.phase_means.iloc[0]
    loop = _value(phase_means.get("loop mean (s)"))
    shares = (
        {
            name: (_value(phase_means.get(f"{name} mean (s)")) or 0.0) / loop * 100
            for name in STEP_PARTS
        }
        if loop
        else {}
    )
    goodput = meta.get("goodput") if isinstance(meta.get("goodput"), dict) else None
    waits: dict[str, float] = {}
    for entry in splits.values():
        ranks = ((entry.get("goodput") or {}).get("ranks") or {}) if isinstance(entry, dict) else {}
        for rank, account in ranks.items():
            waited = (account.get("badput_s") or {}).get("straggler", 0.0)
            waits[rank] = waits.get(rank, 0.0) + float(waited or 0.0)
    loaders = (
        next(
            (s.get("loaders") for s in splits.values() if isinstance(s, dict) and s.get("loaders")),
            None,
        )
        or {}
    )
    return {
        "folder": str(folder),
        "job_id": meta.get("job_id"),
        "user": meta.get("user"),
        "hosts": jobs.hosts(meta),
        "status": meta.get("status"),
        "cause": meta.get("cause"),
        "wall_s": _value(row["wall (s)"]),
        "gpus": int(row["GPUs"]),
        "gpu_model": row["GPU model"] or None,
        "gpu_hours": _value(row["GPU-hours"]),
        "gpu_utilization_pct": _value(row["GPU utilization mean (%)"]),
        "gpu_memory_peak_pct": _value(row["GPU memory peak (%)"]),
        "gpu_memory_peak_mib": _value(row["GPU memory peak (MB)"]),
        "cpu_mean_pct": _value(row["CPU mean (%)"]),
        "memory_peak_mib": _value(row["memory peak (MB)"]),
        "system_memory_peak_pct": _system_memory_pct(folder, meta),
        "data_loading_share_pct": _value(row["data loading share (%)"]),
        "phase_shares_pct": shares,
        "goodput": goodput,
        "straggler_wait_s": waits,
        "loaders": loaders,
        "flags": [f for f in str(row["flags"]).split(",") if f],
        "mfu": {
            k: s["mfu"]
            for k, s in sorted(splits.items())
            if isinstance(s, dict) and isinstance(s.get("mfu"), dict)
        },
    }


def _bar(label: str, pct: float | None, text: str) -> str:
    """``label [####......] text`` with the bar filled to ``pct`` (0-100, capped)."""
    if pct is None:
        return f"{label:<{LABEL}} {'(not measured)'}"
    filled = round(max(0.0, min(pct, 100.0)) / 100 * BAR)
    return f"{label:<{LABEL}} [{'#' * filled}{'.' * (BAR - filled)}] {text}"[:WIDTH]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "running"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _fit(text: str) -> str:
    """``text`` cut to the width, its start replaced by '…' when too long."""
    return text if len(text) <= WIDTH else "…" + text[-(WIDTH - 1) :]


def advice(job: dict[str, Any]) -> list[str]:
    """One line per finding, most wasteful first, as the job report prints them."""
    lines = []
    share = job["data_loading_share_pct"]
    if share is not None and share > jobs.INPUT_BOUND_PCT:
        train = (job["loaders"] or {}).get("train")
        if train is None:
            fix = "load batches with a DataLoader with num_workers > 0"
        else:
            fix = f"raise DataLoader num_workers (now {train['num_workers']})"
            if not train["pin_memory"]:
                fix += " or pin_memory"
        lines.append(f"input-bound: {share:.0f} % of each step waits for data — {fix}")
    util = job["gpu_utilization_pct"]
    if job["gpus"] and util is not None and util < jobs.IDLE_GPU_PCT:
        lines.append(
            f"idle GPU: the GPUs were busy {util:.0f} % of the time — ask for "
            "fewer GPUs or feed them more work"
        )
    memory = job["gpu_memory_peak_pct"]
    if memory is not None and memory > jobs.MEMORY_PRESSURE_PCT:
        lines.append(
            f"GPU memory near full ({memory:.0f} %) — lower the batch size or "
            "checkpoint activations"
        )
    goodput = job["goodput"]
    if goodput and goodput.get("wall_s"):
        wall = float(goodput["wall_s"])
        causes = sorted(
            ((float(goodput["badput_s"].get(c) or 0.0), c) for c in ADVICE), reverse=True
        )
        for seconds, cause in causes:
            if seconds / wall * 100 > BADPUT_ADVICE_SHARE:
                lines.append(
                    f"{SHORT[cause]}: {seconds / wall * 100:.0f} % of the "
                    f"wall time — {ADVICE[cause]}"
                )
    waits = job["straggler_wait_s"]
    if waits and goodput and goodput.get("wall_s"):
        rank, waited = max(waits.items(), key=lambda item: item[1])
        if waited / float(goodput["wall_s"]) * 100 > STRAGGLER_ADVICE_SHARE:
            lines.append(
                f"straggler: rank {rank} waited {waited:.1f} s for the slowest "
                "rank — balance the data or check that host"
            )
    if job["status"] in ("failed", "incomplete"):
        lines.append(f"{job['status']}: {job['cause'] or 'see summary.log'}")
    return lines


def render(job: dict[str, Any]) -> list[str]:
    """The terminal lines of the job report (none wider than ``WIDTH``)."""
    gpus = f"{job['gpus']} × {job['gpu_model']}" if job["gpus"] else "none"
    lines = [
        _fit(f"Job {job['job_id'] or '-'}: {job['folder']}"),
        _fit(
            f"User {job['user'] or '-'}   Host(s) {', '.join(job['hosts']) or '-'}   "
            f"Status {job['status']}"
        ),
        _fit(
            f"Wall {_duration(job['wall_s'])}   GPUs {gpus}   GPU-hours "
            f"{job['gpu_hours'] or 0.0:.2f}"
        ),
        "-" * WIDTH,
    ]
    util, memory = job["gpu_utilization_pct"], job["gpu_memory_peak_pct"]
    lines.append(_bar("GPU utilization", util, f"{util:.0f} % mean" if util is not None else ""))
    lines.append(_bar("GPU memory", memory, f"{memory:.0f} % peak" if memory is not None else ""))
    cpu = job["cpu_mean_pct"]
    lines.append(_bar("CPU", cpu, f"{cpu:.0f} % of one core" if cpu is not None else ""))
    host = job["system_memory_peak_pct"]
    rss = job["memory_peak_mib"]
    lines.append(
        _bar(
            "Host memory",
            host,
            (f"{host:.0f} % peak" if host is not None else "")
            + (f", job {rss:.0f} MiB" if rss is not None else ""),
        )
    )
    lines.append("-" * WIDTH)
    goodput = job["goodput"]
    if goodput and goodput.get("wall_s"):
        wall = float(goodput["wall_s"])
        lines.append(f"Goodput: where {_duration(wall)} went (from the process start)")
        parts = [("productive", float(goodput["productive_s"]))]
        parts += [(c, float(goodput["badput_s"].get(c) or 0.0)) for c in CAUSES]
        for part, seconds in parts:
            if seconds >= 0.005 * wall or part == "productive":
                lines.append(
                    _bar(
                        f"  {SHORT[part]}",
                        seconds / wall * 100,
                        f"{seconds / wall * 100:4.1f} % {seconds:.1f} s",
                    )
                )
        busy = goodput.get("gpu_busy_s")
        if busy is not None and goodput["productive_s"]:
            lines.append(
                f"  GPU busy in productive training: "
                f"{busy / float(goodput['productive_s']) * 100:.0f} %"
            )
    else:
        lines.append("Goodput: not recorded (a folder from an older sidecar)")
    shares = job["phase_shares_pct"]
    if shares:
        lines += _wrap(
            "Phases per step: "
            + ", ".join(f"{name} {share:.0f} %" for name, share in shares.items())
        )
    waits = job["straggler_wait_s"]
    if len(waits) > 1:
        rank, waited = max(waits.items(), key=lambda item: item[1])
        lines.append(
            _fit(
                f"Straggler: rank {rank} waited longest for the slowest rank, {waited:.1f} s"
                if waited > 0
                else "Straggler: none"
            )
        )
    for split, mfu in job["mfu"].items():
        ratio = "unknown" if mfu["mfu"] is None else f"{mfu['mfu'] * 100:.1f} %"
        peak = (
            "no known peak"
            if mfu["peak_tflops"] is None
            else f"{mfu['peak_tflops']:.0f} TFLOP/s peak"
        )
        lines += _wrap(
            f"MFU (estimate, split {split}): {ratio} — "
            f"{mfu['flops_per_batch']:.2e} FLOPs/batch × "
            f"{mfu['batches_per_s']:.2f} batches/s vs {peak} ({mfu['gpu']}, "
            f"{mfu['dtype']})"
        )
    found = advice(job)
    lines += ["-" * WIDTH, "Advice:" if found else "Advice: nothing stands out"]
    for line in found:
        lines += _wrap(f"- {line}")
    return lines


def _wrap(text: str) -> list[str]:
    """``text`` in lines of at most ``WIDTH`` columns, continued lines indented."""
    out: list[str] = []
    line = ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > WIDTH:
            out.append(line)
            line = "  " + word
        else:
            line = f"{line} {word}" if line else word
    return [*out, line]
