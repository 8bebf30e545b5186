"""The resource-field table: one entry per sampled field, declared once.

Each entry says where the value comes from (the sampler and its call), the attribute of
the sample that holds it (``GpuSample`` or ``HostSample``), its column in resources.tsv,
its unit, how the summary folds it (``FieldFigure`` rules, merged across sessions by the same
rule) and the line summary.log shows, and the Prometheus family ``/metrics`` exports, or
none. Everything else derives from this table:

* ``sidecar.sinks.resources_text``: the columns of resources.tsv (``columns()``, in table
  order after ``time (s)`` and ``session``), the summary block's lines, and reading an
  earlier session's samples back;
* ``sidecar.resources.samplers.folding`` and ``sidecar.resources.sessions``: the figures;
* ``sidecar.resources.monitor`` (first readings, integrals), ``gauge_values`` and
  ``sidecar.daemon.snapshot``: the values the gauges export;
* ``sidecar.daemon.metrics``: the metric families;
* ``sidecar.report``: which resources.tsv columns a folder must have.

The tables are read at call time (``fields.GPU_FIELDS``), never copied into constants,
so a test may declare a field and see it everywhere. Adding a field: an entry here with
``required=False`` (files written before it lack the column), the attribute and its
NVML call in the sampler, the fake's answer in ``tests/support/fake_pynvml.py``, and a
test (``docs/samplers.md``, "Adding a field").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sidecar.model.units import BYTES_PER_MIB

# How a field's values are folded into one figure (per session, then across sessions):
#   mean    time-weighted mean (each sample weighs its window); sessions by duration
#   max     the largest value (maxima and peaks); sessions: the largest
#   source  the one value the weighed samples share, else "mixed"; sessions: the same
#   energy  last − first of the energy counter, else ∫ power dt; sessions: the sum
#   energy method  "counter" or "integrated power", the way ``energy`` was taken
Rule = Literal["mean", "max", "source", "energy", "energy method"]
Kind = Literal["gpu", "host"]
Dtype = Literal["float", "int", "text"]
# Which value of a field a gauge exports:
#   latest       the latest sample
#   since_first  latest − the split's first reading (a counter; None if it went back)
#   integral     the sum of value × window over the rounds (percent × s → CPU s with 0.01)
GaugeValue = Literal["latest", "since_first", "integral"]


@dataclass(frozen=True)
class FieldFigure:
    """One summary figure of a field: its name (the key in a summary's ``figures``) and
    the rule that folds the samples into it."""

    name: str
    rule: Rule


@dataclass(frozen=True)
class Line:
    """A line of summary.log's resources block: a label and a ``str.format`` template over
    figure names (any field's: ``{mem_total_mib:.0f}``). An unknown figure prints
    ``n/a``; the spec ``paren`` prints `` (value)``, or nothing when unknown.
    ``hide_unknown`` leaves the line out when its first figure is unknown."""

    label: str
    template: str
    hide_unknown: bool = False


@dataclass(frozen=True)
class Gauge:
    """The Prometheus family a field feeds (one family per field): name without the
    ``_total`` a counter gains, ``gauge`` or ``counter``, help text, which value
    (``GaugeValue``), and the factor from the field's unit to the metric's."""

    name: str
    type: Literal["gauge", "counter"]
    help: str
    value: GaugeValue = "latest"
    scale: float = 1.0


@dataclass(frozen=True)
class ResourceField:
    """One sampled field. ``required`` columns are those every resources.tsv has had; a
    field added later is ``required=False``: files written before it lack its column,
    and their samples read back with it None."""

    kind: Kind
    attribute: str
    source: str
    column: str
    unit: str
    dtype: Dtype = "float"
    figures: tuple[FieldFigure, ...] = ()
    line: Line | None = None
    gauge: Gauge | None = None
    required: bool = True


def _fig(*pairs: tuple[str, Rule]) -> tuple[FieldFigure, ...]:
    return tuple(FieldFigure(name, rule) for name, rule in pairs)


def _gpu(attribute: str, source: str, column: str, unit: str, **more: Any) -> ResourceField:
    """A field of ``GpuSample``; ``more``: the other ``ResourceField`` settings."""
    return ResourceField("gpu", attribute, source, column, unit, **more)


def _host(attribute: str, source: str, column: str, unit: str, **more: Any) -> ResourceField:
    """A field of ``HostSample``; ``more``: the other ``ResourceField`` settings."""
    return ResourceField("host", attribute, source, column, unit, **more)


def _nvml(call: str) -> str:
    """The source of a field read by NVML ``call``."""
    return f"NVML {call}"


def _bytes(name: str, text: str) -> Gauge:
    """A gauge in bytes of a field in MiB."""
    return Gauge(name, "gauge", text, scale=BYTES_PER_MIB)


GPU_FIELDS: tuple[ResourceField, ...] = (
    _gpu("gpu_index", "the job's GPU list", "gpu index", "", dtype="int"),
    _gpu("name", "nvmlDeviceGetName", "gpu name", "", dtype="text"),
    _gpu("uuid", "nvmlDeviceGetUUID", "gpu uuid", "", dtype="text"),
    _gpu(
        "util_pct",
        _nvml("nvmlDeviceGetUtilizationRates.gpu"),
        "utilization (%)",
        "%",
        figures=_fig(("util_mean_pct", "mean"), ("util_max_pct", "max")),
        line=Line("Utilization (%)", "mean {util_mean_pct:.1f}, max {util_max_pct:.1f}"),
        gauge=Gauge(
            "trainmon_gpu_utilization_ratio",
            "gauge",
            "NVML GPU utilization (share of time a kernel ran), 0-1, latest sample",
            scale=0.01,
        ),
    ),
    _gpu(
        "mem_util_pct",
        _nvml("nvmlDeviceGetUtilizationRates.memory"),
        "memory utilization (%)",
        "%",
        figures=_fig(("mem_util_mean_pct", "mean")),
        line=Line("Memory utilization (%)", "mean {mem_util_mean_pct:.1f}"),
    ),
    _gpu(
        "mem_used_mib",
        _nvml("nvmlDeviceGetMemoryInfo (v2) .used"),
        "memory used (MB)",
        "MiB",
        figures=_fig(("mem_used_peak_mib", "max")),
        line=Line("Memory used (MB)", "peak {mem_used_peak_mib:.0f} of {mem_total_mib:.0f}"),
        gauge=_bytes("trainmon_gpu_memory_used_bytes", "device memory used"),
    ),
    _gpu(
        "mem_total_mib",
        _nvml("nvmlDeviceGetMemoryInfo .total"),
        "memory total (MB)",
        "MiB",
        figures=_fig(("mem_total_mib", "max")),
        gauge=_bytes(
            "trainmon_gpu_memory_total_bytes",
            "device memory in all (the alert on memory near full divides by it)",
        ),
    ),
    _gpu(
        "power_w",
        _nvml("ΔE/Δt of the energy counter, else instant or average power"),
        "power (W)",
        "W",
        figures=_fig(("power_mean_w", "mean")),
        line=Line("Power (W)", "mean {power_mean_w:.1f}{power_source:paren}"),
        gauge=Gauge("trainmon_gpu_power_watts", "gauge", "power draw"),
    ),
    _gpu(
        "power_source",
        "which power reading: energy, instant or average",
        "power source",
        "",
        dtype="text",
        figures=_fig(("power_source", "source")),
    ),
    _gpu(
        "energy_j",
        _nvml("nvmlDeviceGetTotalEnergyConsumption"),
        "energy (J)",
        "J",
        figures=_fig(("energy_j", "energy"), ("energy_method", "energy method")),
        line=Line("Energy (J)", "{energy_j:.3e}{energy_method:paren}"),
        gauge=Gauge(
            "trainmon_gpu_energy_joules",
            "counter",
            "GPU energy since the run started",
            value="since_first",
        ),
    ),
    _gpu(
        "temperature_c",
        _nvml("nvmlDeviceGetTemperature(GPU)"),
        "temperature (C)",
        "°C",
        figures=_fig(("temperature_max_c", "max")),
        line=Line("Temperature (C)", "max {temperature_max_c:.0f}"),
        gauge=Gauge("trainmon_gpu_temperature_celsius", "gauge", "temperature"),
    ),
    _gpu("sm_clock_mhz", _nvml("nvmlDeviceGetClockInfo(SM)"), "sm clock (MHz)", "MHz"),
    _gpu(
        "throttle_reasons",
        _nvml("nvmlDeviceGetCurrentClocksEventReasons (ThrottleReasons on older bindings)"),
        "throttle reasons",
        "bitmask",
        dtype="int",
        required=False,
    ),
    _gpu(
        "sm_activity_pct",
        _nvml("GPM NVML_GPM_METRIC_SM_UTIL"),
        "sm activity (%)",
        "%",
        figures=_fig(("sm_activity_mean_pct", "mean")),
        line=Line("SM activity (%)", "mean {sm_activity_mean_pct:.1f}", hide_unknown=True),
    ),
    _gpu(
        "job_mem_mib",
        _nvml("nvmlDevice{Compute,Graphics}RunningProcesses"),
        "job gpu memory (MB)",
        "MiB",
        figures=_fig(("job_mem_peak_mib", "max")),
        line=Line("Job GPU memory (MB)", "peak {job_mem_peak_mib:.0f}"),
        gauge=_bytes("trainmon_gpu_job_memory_bytes", "device memory of the job's own processes"),
    ),
    _gpu(
        "job_sm_util_pct",
        _nvml("nvmlDeviceGetProcessUtilization"),
        "job sm utilization (%)",
        "%",
    ),
)

HOST_FIELDS: tuple[ResourceField, ...] = (
    _host(
        "cpu_pct",
        "psutil cpu_percent, summed over the job's tree",
        "host cpu (%)",
        "% of one core",
        figures=_fig(("cpu_mean_pct", "mean")),
        line=Line("CPU (%)", "mean {cpu_mean_pct:.1f} (100 = one core)"),
        gauge=Gauge(
            "trainmon_job_cpu_seconds",
            "counter",
            "CPU time of the job's process tree",
            value="integral",
            scale=0.01,
        ),
    ),
    _host(
        "rss_mib",
        "psutil memory_info().rss, summed",
        "job memory rss (MB)",
        "MiB",
        figures=_fig(("rss_peak_mib", "max")),
        line=Line("Job memory (MB)", "RSS peak {rss_peak_mib:.0f}, USS peak {uss_peak_mib:.0f}"),
        gauge=_bytes("trainmon_job_memory_rss_bytes", "RSS of the job's process tree"),
    ),
    _host(
        "uss_mib",
        "psutil memory_full_info().uss, summed (every 30 s and at the run's end)",
        "job memory uss (MB)",
        "MiB",
        figures=_fig(("uss_peak_mib", "max")),
    ),
    _host(
        "system_mem_used_pct",
        "psutil virtual_memory().percent",
        "system memory used (%)",
        "%",
        figures=_fig(("system_mem_used_max_pct", "max")),
        line=Line("System memory used (%)", "max {system_mem_used_max_pct:.1f}"),
    ),
)

# The columns of resources.tsv before the fields: seconds since the run started, and the
# session (training process) the sample belongs to.
LEADING_COLUMNS = ("time (s)", "session")


def fields() -> tuple[ResourceField, ...]:
    """Every field, GPU then host: the order of resources.tsv's columns."""
    return GPU_FIELDS + HOST_FIELDS


def columns() -> tuple[str, ...]:
    """resources.tsv's header: the leading columns, then one per field."""
    return LEADING_COLUMNS + tuple(f.column for f in fields())


def required_columns() -> tuple[str, ...]:
    """The columns a resources.tsv must have to be read (any others are ignored).
    ``session`` is not among them: files written before it hold one session."""
    return ("time (s)", *(f.column for f in fields() if f.required))


def gauge_values(
    table: Sequence[ResourceField],
    latest: Any,
    first: Mapping[str, float],
    integrals: Mapping[str, float],
) -> dict[str, float]:
    """Per field of ``table`` with a gauge, its value by the gauge's rule (see
    ``GaugeValue``) times its scale: the ``latest`` sample's value, that value
    minus the ``first`` reading (a counter that went back is unknown), or the integral;
    fields unknown are left out."""
    out = {}
    for field in table:
        gauge = field.gauge
        if gauge is None:
            continue
        value = getattr(latest, field.attribute)
        if gauge.value == "integral":
            value = integrals.get(field.attribute)
        elif gauge.value == "since_first" and value is not None:
            start = first.get(field.attribute)
            value = value - start if start is not None and value >= start else None
        if value is not None:
            out[gauge.name] = value * gauge.scale
    return out
