"""The resources block of summary.log and the rows of resources.tsv, laid out from the
figures of ``sidecar.resources.samplers.folding`` by the field table
(``sidecar.resources.fields``: columns, lines, units; MB means MiB, as in every file).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.resources import fields
from sidecar.resources.samplers.folding import GpuSummary, HostSummary, PhaseAttribution
from sidecar.resources.samplers.host import HostSample
from sidecar.resources.samplers.nvml import GpuSample
from sidecar.resources.sessions import session_of
from sidecar.sinks.layout import WIDTH

if TYPE_CHECKING:
    import pandas as pd


class _FigureFormatter(string.Formatter):
    """Formats a figure as the block prints it: ``n/a`` when unknown; the spec ``paren``
    gives `` (value)``, or nothing when unknown."""

    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec == "paren":
            return "" if value is None else f" ({value})"
        return "n/a" if value is None else format(value, format_spec)


_FORMATTER = _FigureFormatter()


def _num(value: float | None, fmt: str = ".1f") -> str:
    return _FORMATTER.format_field(value, fmt)


def _row(label: str, text: str) -> str:
    return f"  {label:<26}{text}"


def _field_lines(table: Sequence[fields.ResourceField], figures: Mapping[str, Any]) -> list[str]:
    """One line per field of ``table`` that has one, from its template over ``figures``."""
    lines = []
    for field in table:
        line = field.line
        if line is None or (line.hide_unknown and figures[field.figures[0].name] is None):
            continue
        lines.append(_row(line.label, _FORMATTER.vformat(line.template, (), figures)))
    return lines


def _gpu_lines(gpu: GpuSummary) -> list[str]:
    lines = [
        f"GPU {gpu.gpu_index}: '{gpu.name[:40]}' {gpu.uuid[:44]} "
        f"({gpu.n_samples} samples over {gpu.duration_s:.1f} s)"
    ]
    if gpu.whole_gpu_uuid:
        lines += [
            _row("", f"power, energy, temperature: the whole GPU {gpu.whole_gpu_uuid[:44]},")[
                :WIDTH
            ],
            _row("", "shared by its MIG instances"),
        ]
    return lines + _field_lines(fields.GPU_FIELDS, gpu.figures)


def _attribution_lines(attribution: dict[str, PhaseAttribution]) -> list[str]:
    width = min(40, max(22, *(len(label) for label in attribution)))
    lines = [
        "",
        "GPU utilization and power during each phase (samples weighted by their overlap)",
        f"{'Phase':^{width}} | Covered (s) | Samples | GPU utilization (%) | Power per GPU (W)",
        "-" * WIDTH,
    ]
    for label, phase in attribution.items():
        lines.append(
            f"{label[:width]:<{width}} | {phase.covered_s:>11.2f} | "
            f"{phase.n_samples:>7} | {_num(phase.util_mean_pct):>19} | "
            f"{_num(phase.power_mean_w):>17}"
        )
    lines.append(
        "NVML utilization is averaged over 1/6-1 s and each sample stands for a whole "
        "interval: short phases"
    )
    lines.append(
        "are smeared; read these as where the GPU time went, not as figures of one short phase."
    )
    return lines


def resources_block(
    gpu: list[GpuSummary],
    host: HostSummary | None,
    gpu_off_reason: str | None,
    attribution: dict[str, PhaseAttribution],
    records_lines: Sequence[str],
) -> list[str]:
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
        lines.append(f"Host: job processes ({host.n_samples} samples)")
        lines += _field_lines(fields.HOST_FIELDS, host.figures)
    if attribution:
        lines.extend(_attribution_lines(attribution))
    lines += ["", *records_lines]
    return lines


def resources_frame(
    gpu_samples: Sequence[GpuSample],
    host_samples: Sequence[HostSample],
    run_start_ns: int,
    session_starts_ns: Sequence[int] = (),
) -> pd.DataFrame:
    """The rows of resources.tsv: one per sample and GPU, ordered by time and GPU index,
    with ``fields.columns()``. Host figures join the GPU rows of the same round (same
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
    table = fields.fields()
    records = [
        [(t_ns - run_start_ns) / 1e9, session_of(t_ns, session_starts_ns)]
        + [_value(field, g, h) for field in table]
        for t_ns, _, g, h in rows
    ]
    import pandas as pd  # only when writing (see sinks/tables.py)

    frame = pd.DataFrame.from_records(records, columns=list(fields.columns()))
    shared = [
        g is not None and g.whole_gpu_uuid is not None and g.power_source is not None
        for _, _, g, _ in rows
    ]
    if any(shared):  # a MIG instance: the whole GPU's power, shared with other tenants
        frame.loc[shared, "power source"] += " (whole GPU, shared)"
    frame["session"] = frame["session"].astype("Int64")
    for field in table:
        frame[field.column] = frame[field.column].astype(_DTYPES[field.dtype])
    frame["time (s)"] = frame["time (s)"].astype(float)
    return frame


def _value(field: fields.ResourceField, gpu: GpuSample | None, host: HostSample | None) -> Any:
    """``field``'s value in a row of the GPU sample ``gpu`` and the host sample ``host``."""
    sample = gpu if field.kind == "gpu" else host
    return None if sample is None else getattr(sample, field.attribute)


# How each dtype of the table is held in a frame: integers may be missing (CPU-only rows).
_DTYPES = {"float": "float64", "int": "Int64", "text": object}


def read_samples(
    path: Path,
    run_start_ns: int,
    before_session: int,
) -> tuple[list[GpuSample], list[HostSample]]:
    """The samples of sessions before ``before_session`` in a resources.tsv we wrote, back
    on the clock whose run start is ``run_start_ns`` (a resumed run's sidecar reads its
    predecessors' samples). Columns other than the table's are ignored, and a field whose
    column the file lacks (one added to the table later) reads None. ([], []) when the
    file is missing, not ours, or lacks a required column.
    """
    import pandas as pd  # only when writing (see sinks/tables.py)

    text_columns = {f.column: str for f in fields.fields() if f.dtype == "text"}
    try:
        frame = pd.read_csv(path, sep="\t", keep_default_na=True, dtype=text_columns)
    except (OSError, ValueError, pd.errors.ParserError):
        return [], []
    if not set(fields.required_columns()) <= set(frame.columns):
        return [], []
    if "session" not in frame.columns:  # written before sessions were told apart: one
        frame["session"] = 0
    frame = frame[frame["session"] < before_session]
    frame = frame.astype(object).where(frame.notna(), None)
    records = frame.to_dict("records")
    gpu: list[GpuSample] = []
    host: dict[int, HostSample] = {}
    for values in records:
        t_ns = run_start_ns + round(float(values["time (s)"]) * 1e9)
        if values["gpu uuid"] is not None:
            read = _attributes(fields.GPU_FIELDS, values)
            for field in fields.GPU_FIELDS:  # integers read back as floats (NaN allowed)
                if field.dtype == "int" and read[field.attribute] is not None:
                    read[field.attribute] = int(read[field.attribute])
            gpu.append(GpuSample(t_ns=t_ns, **read))
        if values["host cpu (%)"] is not None and t_ns not in host:
            host[t_ns] = HostSample(
                t_ns=t_ns, n_processes=0, **_attributes(fields.HOST_FIELDS, values)
            )
    return gpu, list(host.values())


def _attributes(table: Sequence[fields.ResourceField], values: Mapping[str, Any]) -> dict[str, Any]:
    """The sample attributes of ``table`` from a row's ``values`` by column (None for a
    column the file lacks)."""
    return {f.attribute: values.get(f.column) for f in table}
