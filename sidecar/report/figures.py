"""Per-split figures from the raw files of many splits, computed in bulk.

The tables of all splits are joined into one buffer, each line prefixed with the number
of its split (a C-level ``bytes.replace``), and parsed by one ``pandas.read_csv`` call
that keeps only the columns the report uses; the figures are then grouped sums over
numpy arrays. No Python object is made per table row, so 10 000 run folders take
seconds, not minutes.

Resource figures follow ``sidecar.resources.samplers.folding`` exactly (the summary.log figures):
a sample weighs the time since the sample before it of the same GPU (of the job, for the
host columns), the first weighs nothing unless it is the only one; energy is the
counter's last − first where it has two readings and did not go back, else the integral
of power over the sample windows. Both per session (one training process: a resume starts
a new one, ``sidecar.resources.sessions``): a session's first sample opens a new clock and
the energies of the sessions add up, so the downtime between processes counts nowhere.

A split served by several nodes has one resources table per node (docs/multi-node.md):
each is computed on its own (its own clock, its own host), then the split's nodes are
combined: CPU summed, memory peak the largest, each GPU once.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from markers import wire
from sidecar.report.read import SplitFiles
from sidecar.resources import fields
from sidecar.sinks.summary import TITLE_LINE
from sidecar.sinks.tables import COLUMNS

# The phases the report reads from computational.tsv, the training loop and the step parts,
# by their name here: the metric label without the loop's "train_" prefix.
READ_PHASES: dict[str, wire.PhaseDef] = {
    p.metric.removeprefix("train_"): p
    for p in wire.PHASES
    if (p.loop and not p.validation) or p.step
}
PHASE_COLUMNS = {name: p.column for name, p in READ_PHASES.items()}  # name -> column label
# The step parts by those names, in table order (each one's share of the step).
STEP_PARTS = tuple(name for name, p in READ_PHASES.items() if p.step)
PLOT_POINTS = 400
_LABELS = [label for label, _, _ in COLUMNS]
_THROUGHPUT = re.compile(r"^Throughput: (?:([0-9.e+-]+) images/s|.*)$", re.M)
_RECORDS = re.compile(r"^Records: received \d+, dropped (\d+)", re.M)


@dataclass(frozen=True)
class Figures:
    """Figures of many splits: ``splits`` has one row per split (in the order given),
    ``gpus`` one row per split and GPU (UUID), ``utilization`` the samples behind the GPU
    utilization plot (split, gpu index, time s, utilization %), at most ``PLOT_POINTS``
    per split and GPU."""

    splits: pd.DataFrame
    gpus: pd.DataFrame
    utilization: pd.DataFrame


def _joined(bodies: Sequence[bytes]) -> bytes:
    """The bodies as one buffer, each line prefixed by ``<position>\\t``."""
    parts = []
    for i, body in enumerate(bodies):
        if body:
            prefix = b"%d\t" % i
            parts.append(prefix + body[:-1].replace(b"\n", b"\n" + prefix) + b"\n")
    return b"".join(parts)


def _read(
    bodies: Sequence[bytes],
    fields: int,
    usecols: dict[str, int],
    dtypes: dict[str, str] | None = None,
) -> pd.DataFrame:
    """One frame of the chosen columns (by position in the file) of all ``bodies``, with
    the position of each line's body in column ``split``."""
    buffer = _joined(bodies)
    names = ["split", *(f"c{i}" for i in range(fields))]
    if not buffer:
        return pd.DataFrame(
            {"split": pd.Series(dtype="int64")}
            | {name: pd.Series(dtype=(dtypes or {}).get(name, "float64")) for name in usecols}
        )
    columns = {f"c{position}": name for name, position in usecols.items()}
    types = {f"c{usecols[name]}": kind for name, kind in (dtypes or {}).items()}
    frame = pd.read_csv(
        io.BytesIO(buffer),
        sep="\t",
        header=None,
        names=names,
        usecols=["split", *columns],
        dtype=types | {"split": "int64"},
        engine="c",
    )
    return frame.rename(columns=columns)


def _group_mean(split: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    """Mean of ``values`` per split (NaN ignored; NaN where a split has none)."""
    present = ~np.isnan(values)
    sums = np.bincount(split[present], weights=values[present], minlength=count)
    n = np.bincount(split[present], minlength=count)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, sums / np.maximum(n, 1), np.nan)


def _phase_means(files: Sequence[SplitFiles]) -> pd.DataFrame:
    fields = max((f.computational_columns for f in files), default=1)
    positions = {name: _LABELS.index(f"{label} (s)") for name, label in PHASE_COLUMNS.items()}
    frame = _read(
        [f.computational for f in files], fields, positions, dict.fromkeys(positions, "float64")
    )
    split = frame["split"].to_numpy()
    return pd.DataFrame(
        {
            f"{name} mean (s)": _group_mean(split, frame[name].to_numpy(float), len(files))
            for name in PHASE_COLUMNS
        }
    )


def _stated_figures(files: SplitFiles) -> tuple[float, float, int]:
    """The split's training and validation throughput (NaN unknown) and its records
    dropped, as its run.json entry states them; from summary.log's text for a folder
    written before run.json held them (one regex per figure; text of others before our
    block is not read)."""
    entry = files.entry
    stated = entry.get("throughput")
    if isinstance(stated, dict) and isinstance(entry.get("records_dropped"), int):
        train, val = (stated.get(loop) for loop in ("train", "val"))
        return (
            float(train) if isinstance(train, (int, float)) else np.nan,
            float(val) if isinstance(val, (int, float)) else np.nan,
            int(entry["records_dropped"]),
        )
    block = files.summary[files.summary.index(TITLE_LINE) :]  # read.py checked it is there
    throughputs = [float(m[1]) if m[1] else np.nan for m in _THROUGHPUT.finditer(block)]
    throughputs += [np.nan] * (2 - len(throughputs))
    records = _RECORDS.search(block)
    return throughputs[0], throughputs[1], int(records[1]) if records else 0


def _summary_figures(files: Sequence[SplitFiles]) -> pd.DataFrame:
    """Throughputs and dropped records of each split (``_stated_figures``)."""
    stated = [_stated_figures(f) for f in files]
    return pd.DataFrame(stated, columns=["train throughput", "val throughput", "dropped"]).astype(
        {"train throughput": "float64", "val throughput": "float64", "dropped": "int64"}
    )


def _windows(group: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Each sample's window: time since the previous sample of its group (0 for a first).
    ``group`` must be contiguous, each group in time order."""
    dt = np.diff(t, prepend=t[:1])
    if len(group):
        dt[np.r_[True, group[1:] != group[:-1]]] = 0.0
    return dt


def _session_starts(group: np.ndarray, session: np.ndarray) -> np.ndarray:
    """True where a row begins a new session within its (contiguous) group."""
    if not len(group):
        return np.zeros(0, bool)
    return np.r_[False, (group[1:] == group[:-1]) & (session[1:] != session[:-1])]


def _energy_over_sessions(
    group: np.ndarray,
    session: np.ndarray,
    dt: np.ndarray,
    energy: np.ndarray,
    power: np.ndarray,
    count: int,
) -> np.ndarray:
    """Joules per group: ``_energy`` of each (group, session) run of rows, summed; NaN
    where no session of the group has an energy."""
    if not len(group):
        return np.full(count, np.nan)
    begins = np.r_[True, (group[1:] != group[:-1]) | (session[1:] != session[:-1])]
    part = np.cumsum(begins) - 1
    parts = _energy(part, dt, energy, power, int(part[-1]) + 1)
    owner = group[begins]
    known = ~np.isnan(parts)
    total = np.bincount(owner[known], weights=parts[known], minlength=count)
    return np.where(np.bincount(owner[known], minlength=count) > 0, total, np.nan)


def _weighted_mean(group: np.ndarray, dt: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    """Per group: mean of ``values`` weighted by ``dt`` (NaN skipped); the plain mean where
    the weights add up to nothing (one sample); NaN where nothing is present."""
    present = ~np.isnan(values)
    g, w, v = group[present], dt[present], values[present]
    num = np.bincount(g, weights=w * v, minlength=count)
    den = np.bincount(g, weights=w, minlength=count)
    plain = _group_mean(group, values, count)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), plain)


def _group_max(group: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    out = np.full(count, -np.inf)
    present = ~np.isnan(values)
    np.maximum.at(out, group[present], values[present])
    return np.where(np.isfinite(out), out, np.nan)


def _energy(
    group: np.ndarray, dt: np.ndarray, energy: np.ndarray, power: np.ndarray, count: int
) -> np.ndarray:
    """Joules per group: the counter's last − first (two readings, no reset), else the
    integral of power over the windows; NaN when neither is known."""
    present = ~np.isnan(energy)
    g = group[present]
    e = energy[present]
    first = np.full(count, np.nan)
    last = np.full(count, np.nan)
    first[g[::-1]] = e[::-1]  # fancy assignment: the last write wins, so reversed = first
    last[g] = e
    readings = np.bincount(g, minlength=count)
    counter = np.where((readings >= 2) & (last >= first), last - first, np.nan)
    has_power = ~np.isnan(power)
    joules = np.bincount(group[has_power], weights=(power * dt)[has_power], minlength=count)
    seconds = np.bincount(group[has_power], weights=dt[has_power], minlength=count)
    return np.where(~np.isnan(counter), counter, np.where(seconds > 0, joules, np.nan))


_RESOURCE_NAMES = {
    "time": "time (s)",
    "index": "gpu index",
    "name": "gpu name",
    "uuid": "gpu uuid",
    "util": "utilization (%)",
    "mem_used": "memory used (MB)",
    "mem_total": "memory total (MB)",
    "power": "power (W)",
    "energy": "energy (J)",
    "cpu": "host cpu (%)",
    "rss": "job memory rss (MB)",
    "session": "session",
}


def _resource_columns(parts: Sequence[tuple[bytes, tuple[str, ...]]]) -> pd.DataFrame:
    """The columns the report reads (``_RESOURCE_NAMES``) of every resources table (body,
    header), found by name, the position of its table in column ``split``: files of
    another version (columns appended since, or optional ones missing) are read with
    their own header, one ``_read`` per header seen."""
    text = {"name": "category", "uuid": "category"}
    dtypes = {k: text.get(k, "float64") for k in _RESOURCE_NAMES}
    frames = []
    for header in dict.fromkeys(h for _, h in parts) or [fields.columns()]:
        positions = {
            name: header.index(label) for name, label in _RESOURCE_NAMES.items() if label in header
        }  # only optional ones can be missing (read.py)
        frame = _read(
            [body if h == header else b"" for body, h in parts],
            len(header),
            positions,
            {k: v for k, v in dtypes.items() if k in positions},
        )
        frames.append(frame.reindex(columns=["split", *_RESOURCE_NAMES]))  # missing: NaN
    if len(frames) == 1:
        return frames[0]
    # rows of one table stay together and in file order: what the windows below assume
    frame = pd.concat(frames, ignore_index=True).sort_values("split", kind="stable")
    return frame.astype({k: kind for k, kind in dtypes.items() if kind == "category"})


def _tables(files: Sequence[SplitFiles]) -> tuple[list[tuple[bytes, tuple[str, ...]]], np.ndarray]:
    """Every resources table of ``files`` (rank 0's node's first, then each other node's)
    as (body, header), and the position in ``files`` of the split each belongs to."""
    tables = [
        table for f in files for table in ((f.resources, f.resources_columns), *f.node_resources)
    ]
    owner = np.repeat(np.arange(len(files)), [1 + len(f.node_resources) for f in files])
    return tables, owner


def _sum_over(owner: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    """Per owner: the sum of ``values`` (NaN skipped; NaN where every one is NaN)."""
    present = ~np.isnan(values)
    total = np.bincount(owner[present], weights=values[present], minlength=count)
    return np.where(np.bincount(owner[present], minlength=count) > 0, total, np.nan)


def _resources(files: Sequence[SplitFiles]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Per split: its host figures, its GPUs' figures and the plot's samples. Each node's
    table (one host's samples) is computed on its own, then a split's nodes combined:
    CPU summed, memory peak the largest, each GPU (UUID) once (see ``_per_split_gpus``)."""
    tables, owner = _tables(files)
    frame = _resource_columns(tables)
    count = len(tables)
    split = frame["split"].to_numpy()
    t = frame["time"].to_numpy(float)

    # host: one row per sampling round that has host figures (GPU rows repeat them)
    host_rows = ~(np.isnan(frame["cpu"].to_numpy(float)) & np.isnan(frame["rss"].to_numpy(float)))
    host_rows &= np.r_[True, (split[1:] != split[:-1]) | (t[1:] != t[:-1])]
    hs, ht = split[host_rows], t[host_rows]
    hdt = _windows(hs, ht)
    sessions = np.nan_to_num(frame["session"].to_numpy(float))
    hdt[_session_starts(hs, sessions[host_rows])] = 0.0
    cpu = _weighted_mean(hs, hdt, frame["cpu"].to_numpy(float)[host_rows], count)
    rss = _group_max(hs, frame["rss"].to_numpy(float)[host_rows], count)
    host = pd.DataFrame(
        {
            # the job's CPU on every node (100 = one core), its largest node's memory
            "cpu mean (%)": _sum_over(owner, cpu, len(files)),
            "memory peak (MB)": _group_max(owner, rss, len(files)),
        }
    )

    # GPUs (by UUID): rows of one (table, GPU) made contiguous, each still in time order
    gpu = frame[frame["uuid"].notna()]
    codes = gpu["uuid"].cat.codes.to_numpy()
    order = np.lexsort((codes, gpu["split"].to_numpy()))
    gpu = gpu.iloc[order]
    keys, group = np.unique(
        np.stack([gpu["split"].to_numpy(), codes[order]]), axis=1, return_inverse=True
    )
    group = group.ravel()
    n = keys.shape[1]
    gt = gpu["time"].to_numpy(float)
    gs = np.nan_to_num(gpu["session"].to_numpy(float))
    dt = _windows(group, gt)
    dt[_session_starts(group, gs)] = 0.0
    last = np.r_[group[1:] != group[:-1], True] if len(group) else np.zeros(0, bool)
    power = gpu["power"].to_numpy(float)
    gpus = pd.DataFrame(
        {
            "split": owner[keys[0]],
            "gpu": gpu["index"].to_numpy(int)[last],
            "uuid": np.asarray(gpu["uuid"].array[last], dtype=str),
            "model": np.asarray(gpu["name"].array[last], dtype=str),
            "utilization mean (%)": _weighted_mean(group, dt, gpu["util"].to_numpy(float), n),
            "memory peak (MB)": _group_max(group, gpu["mem_used"].to_numpy(float), n),
            "memory total (MB)": _group_max(group, gpu["mem_total"].to_numpy(float), n),
            "power mean (W)": _weighted_mean(group, dt, power, n),
            "energy (J)": _energy_over_sessions(
                group, gs, dt, gpu["energy"].to_numpy(float), power, n
            ),
        }
    )
    # the plots' samples: rank 0's node's GPUs (another node's may have the same
    # indices), at most PLOT_POINTS per GPU, evenly thinned
    sizes = np.bincount(group, minlength=n)
    first = np.cumsum(sizes) - sizes
    position = np.arange(len(group)) - first[group]
    keep = position % np.maximum(1, -(-sizes // PLOT_POINTS))[group] == 0
    table = gpu["split"].to_numpy()
    keep &= np.r_[True, owner[1:] != owner[:-1]][table]  # the first table of its split
    utilization = pd.DataFrame(
        {
            "split": owner[table[keep]],
            "gpu": gpu["index"].to_numpy(int)[keep],
            "time (s)": gt[keep],
            "utilization (%)": gpu["util"].to_numpy(float)[keep],
        }
    )
    return host, _per_split_gpus(gpus), utilization


_ONCE_PER_GPU = {
    "gpu": "first",
    "model": "first",
    "utilization mean (%)": "mean",
    "memory peak (MB)": "max",
    "memory total (MB)": "max",
    "power mean (W)": "mean",
    "energy (J)": "max",
}


def _per_split_gpus(gpus: pd.DataFrame) -> pd.DataFrame:
    """One row per split and GPU from one per node table and GPU. A GPU in several nodes'
    tables (two sidecars on one host that both sampled it) counts once: its largest
    energy and peaks, its mean utilization and power."""
    if not gpus.duplicated(["split", "uuid"]).any():
        return gpus.reset_index(drop=True)
    once = gpus.groupby(["split", "uuid"], sort=False).agg(_ONCE_PER_GPU).reset_index()
    return once[list(gpus.columns)]


def compute(files: Sequence[SplitFiles]) -> Figures:
    """The figures of ``files`` (row i of ``splits`` is ``files[i]``)."""
    host, gpus, utilization = _resources(files)
    splits = pd.concat([_phase_means(files), _summary_figures(files), host], axis=1)
    return Figures(splits, gpus, utilization)
