"""The resources block of summary.log and the rows of resources.tsv, laid out from the
figures of ``sidecar.resources.samplers.summary`` (MB means MiB, as in every file).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample
from sidecar.resources.samplers.summary import GpuSummary, HostSummary, PhaseAttribution
from sidecar.resources.sessions import session_of
from sidecar.sinks.layout import WIDTH

if TYPE_CHECKING:
    import pandas as pd

RESOURCES_COLUMNS = (
    "time (s)", "session", "gpu index", "gpu name", "gpu uuid", "utilization (%)",
    "memory utilization (%)", "memory used (MB)", "memory total (MB)", "power (W)",
    "power source", "energy (J)", "temperature (C)", "sm clock (MHz)", "sm activity (%)",
    "job gpu memory (MB)", "job sm utilization (%)", "host cpu (%)", "job memory rss (MB)",
    "job memory uss (MB)", "system memory used (%)",
)
# The GpuSample and HostSample attributes behind RESOURCES_COLUMNS[1:], in that order.
_GPU_ATTRIBUTES = (
    "gpu_index", "name", "uuid", "util_pct", "mem_util_pct", "mem_used_mib", "mem_total_mib",
    "power_w", "power_source", "energy_j", "temperature_c", "sm_clock_mhz",
    "sm_activity_pct", "job_mem_mib", "job_sm_util_pct",
)
_HOST_ATTRIBUTES = ("cpu_pct", "rss_mib", "uss_mib", "system_mem_used_pct")
_TEXT_COLUMNS = ("session", "gpu index", "gpu name", "gpu uuid", "power source")



def _num(value: float | None, fmt: str = ".1f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _row(label: str, text: str) -> str:
    return f"  {label:<26}{text}"


def _gpu_lines(gpu: GpuSummary) -> list[str]:
    lines = [
        f"GPU {gpu.gpu_index}: '{gpu.name[:40]}' {gpu.uuid[:44]} "
        f"({gpu.n_samples} samples over {gpu.duration_s:.1f} s)",
        _row("Utilization (%)", f"mean {_num(gpu.util_mean_pct)}, max {_num(gpu.util_max_pct)}"),
        _row("Memory utilization (%)", f"mean {_num(gpu.mem_util_mean_pct)}"),
        _row("Memory used (MB)",
             f"peak {_num(gpu.mem_used_peak_mib, '.0f')} of {_num(gpu.mem_total_mib, '.0f')}"),
        _row("Job GPU memory (MB)", f"peak {_num(gpu.job_mem_peak_mib, '.0f')}"),
        _row("Power (W)", f"mean {_num(gpu.power_mean_w)}"
             + (f" ({gpu.power_source})" if gpu.power_source else "")),
        _row("Energy (J)", _num(gpu.energy_j, ".3e")
             + (f" ({gpu.energy_method})" if gpu.energy_method else "")),
        *([_row("", f"power, energy, temperature: the whole GPU {gpu.whole_gpu_uuid[:44]},")[
            :WIDTH], _row("", "shared by its MIG instances")] if gpu.whole_gpu_uuid else []),
        _row("Temperature (C)", f"max {_num(gpu.temperature_max_c, '.0f')}"),
    ]
    if gpu.sm_activity_mean_pct is not None:
        lines.append(_row("SM activity (%)", f"mean {_num(gpu.sm_activity_mean_pct)}"))
    return lines


def _attribution_lines(attribution: dict[str, PhaseAttribution]) -> list[str]:
    width = min(40, max(22, *(len(label) for label in attribution)))
    lines = [
        "",
        "GPU utilization and power during each phase (samples weighted by their overlap)",
        f"{'Phase':^{width}} | Covered (s) | Samples | GPU utilization (%) | Power per GPU (W)",
        "-" * WIDTH,
    ]
    for label, phase in attribution.items():
        lines.append(f"{label[:width]:<{width}} | {phase.covered_s:>11.2f} | "
                     f"{phase.n_samples:>7} | {_num(phase.util_mean_pct):>19} | "
                     f"{_num(phase.power_mean_w):>17}")
    lines.append("NVML utilization is averaged over 1/6-1 s and each sample stands for a whole "
                 "interval: short phases")
    lines.append("are smeared; read these as where the GPU time went, not as figures of one "
                 "short phase.")
    return lines


def resources_block(gpu: list[GpuSummary], host: HostSummary | None,
                    gpu_off_reason: str | None, attribution: dict[str, PhaseAttribution],
                    records_lines: Sequence[str]) -> list[str]:
    """The lines (no newlines, at most 106 characters) of summary.log's resources block.

    ``gpu_off_reason`` set means GPU sampling was off (or stopped) and is said so; GPU
    summaries given with it are still shown. ``attribution`` may be empty.
    """
    lines = ["Resources", "-" * WIDTH]
    if gpu_off_reason is not None:
        lines.append(f"GPU sampling: off ({gpu_off_reason})"[:WIDTH])
    elif not gpu:
        lines.append("GPU sampling: on, no samples")
    for summary in gpu:
        lines.extend(_gpu_lines(summary))
    if host is not None:
        lines += [
            f"Host: job processes ({host.n_samples} samples)",
            _row("CPU (%)", f"mean {_num(host.cpu_mean_pct)} (100 = one core)"),
            _row("Job memory (MB)", f"RSS peak {_num(host.rss_peak_mib, '.0f')}, "
                                    f"USS peak {_num(host.uss_peak_mib, '.0f')}"),
            _row("System memory used (%)", f"max {_num(host.system_mem_used_max_pct)}"),
        ]
    if attribution:
        lines.extend(_attribution_lines(attribution))
    lines += ["", *records_lines]
    return lines


def resources_frame(gpu_samples: Sequence[GpuSample], host_samples: Sequence[HostSample],
                    run_start_ns: int, session_starts_ns: Sequence[int] = ()) -> pd.DataFrame:
    """The rows of resources.tsv: one per sample and GPU, ordered by time and GPU index,
    with ``RESOURCES_COLUMNS``. Host figures join the GPU rows of the same round (same
    ``t_ns``); a round without GPU samples (a CPU-only run) gives one row with empty GPU
    columns. Time is seconds since ``run_start_ns``; ``session`` the process it belongs to
    (by ``session_starts_ns``, 0 for the first); MB means MiB."""
    host_by_t = {h.t_ns: h for h in host_samples}
    gpu_rounds = {s.t_ns for s in gpu_samples}
    rows: list[tuple[int, int, GpuSample | None, HostSample | None]] = [
        (s.t_ns, s.gpu_index, s, host_by_t.get(s.t_ns)) for s in gpu_samples
    ]
    rows += [(h.t_ns, -1, None, h) for h in host_samples if h.t_ns not in gpu_rounds]
    rows.sort(key=lambda row: (row[0], row[1]))
    records = [
        [(t_ns - run_start_ns) / 1e9, session_of(t_ns, session_starts_ns)]
        + [None if g is None else getattr(g, a) for a in _GPU_ATTRIBUTES]
        + [None if h is None else getattr(h, a) for a in _HOST_ATTRIBUTES]
        for t_ns, _, g, h in rows
    ]
    import pandas as pd  # only when writing (see sinks/tables.py)

    frame = pd.DataFrame.from_records(records, columns=list(RESOURCES_COLUMNS))
    shared = [g is not None and g.whole_gpu_uuid is not None and g.power_source is not None
              for _, _, g, _ in rows]
    if any(shared):  # a MIG instance: the whole GPU's power, shared with other tenants
        frame.loc[shared, "power source"] += " (whole GPU, shared)"
    frame["session"] = frame["session"].astype("Int64")
    frame["gpu index"] = frame["gpu index"].astype("Int64")
    for column in _TEXT_COLUMNS[2:]:
        frame[column] = frame[column].astype(object)
    numeric = [c for c in RESOURCES_COLUMNS if c not in _TEXT_COLUMNS]
    frame[numeric] = frame[numeric].astype(float)
    return frame


def read_samples(path: Path, run_start_ns: int, before_session: int,
                 ) -> tuple[list[GpuSample], list[HostSample]]:
    """The samples of sessions before ``before_session`` in a resources.tsv we wrote, back
    on the clock whose run start is ``run_start_ns`` (a resumed run's sidecar reads its
    predecessors' samples). ([], []) when the file is missing or not ours.
    """
    import pandas as pd  # only when writing (see sinks/tables.py)

    try:
        frame = pd.read_csv(path, sep="\t", keep_default_na=True,
                            dtype={"gpu name": str, "gpu uuid": str, "power source": str})
    except (OSError, ValueError, pd.errors.ParserError):
        return [], []
    if list(frame.columns) != list(RESOURCES_COLUMNS):
        return [], []
    frame = frame[frame["session"] < before_session]
    frame = frame.astype(object).where(frame.notna(), None)
    gpu: list[GpuSample] = []
    host: dict[int, HostSample] = {}
    for row in frame.itertuples(index=False, name=None):
        values = dict(zip(RESOURCES_COLUMNS, row, strict=True))
        t_ns = run_start_ns + round(float(values["time (s)"]) * 1e9)
        if values["gpu uuid"] is not None:
            fields = dict(zip(_GPU_ATTRIBUTES, (values[c] for c in RESOURCES_COLUMNS[2:17]),
                              strict=True))
            fields["gpu_index"] = int(fields["gpu_index"])
            gpu.append(GpuSample(t_ns=t_ns, **fields))
        if values["host cpu (%)"] is not None and t_ns not in host:
            host[t_ns] = HostSample(t_ns, *(values[c] for c in RESOURCES_COLUMNS[17:]),
                                    n_processes=0)
    return gpu, list(host.values())
