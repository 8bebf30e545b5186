"""The text of our blocks in ``summary.log`` and their replacement inside a file that may
hold other people's text (docs/contract.md, Files).

Four blocks, in this order, each closed by a line of 106 stars:

1. the reference's ``Computational Summary`` block, line for line as the reference prints
   it (title, GPU names on a GPU, the training and validation tables, throughput), so a
   script that reads from its title to the first star line reads what it knows;
2. our additions, under a title line of their own: the Training time account, the
   streaming figures over all post-warmup measurements, custom phases, ranks;
3. the Goodput block (``sinks/goodput_text.py``): the wall time as productive training
   plus badput by cause;
4. the resources block, under the line ``Resources``.

Every ``mean ± std [n]`` cell uses the sample standard deviation (n − 1 in the
denominator), as pandas' ``Series.std()`` in the reference.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from markers import wire
from markers.buffer import GPU_DRAIN_S
from sidecar.model.aggregator import RankAggregator
from sidecar.model.series import PhaseSeries
from sidecar.model.stats import Welford
from sidecar.sinks import layout, rowtext


def _title_line(title: str) -> str:
    """``title`` centred in a line of stars ``layout.WIDTH`` wide (one star more on the left
    when odd, as the reference centres its title)."""
    stars = layout.WIDTH - len(title)
    return "*" * ((stars + 1) // 2) + title + "*" * (stars // 2)


TITLE_LINE = _title_line(" Computational Summary (mean ± std [n measurements]) ")
ADDITIONS_LINE = _title_line(
    " Beyond the reference: training time, all measurements, custom phases, ranks "
)
STARS = "*" * layout.WIDTH
DASHES = "-" * layout.WIDTH
RESOURCES = "Resources"


def cell(values: Sequence[float] | np.ndarray) -> str:
    """``mean ± std [n]`` in %.2e with the sample std (n − 1), ``mean [1]`` for one value,
    '' for none.

    Computed as the reference computes it, with pandas' ``mean()`` and ``std()``: a mean
    that falls on a rounding tie of %.2e (exact values such as 6.875e-04) then prints the
    reference's digits, not those of a differently rounded sum.
    """
    if len(values) == 0:
        return ""
    if len(values) == 1:
        return f"{values[0]:.2e} [1]"
    import pandas as pd  # only when writing (see sinks/tables.py)

    series = pd.Series(values, dtype="float64")
    return f"{series.mean():.2e} ± {series.std():.2e} [{len(values)}]"


def welford_cell(stats: Welford) -> str:
    """The same cell from streaming statistics (their std is the sample std too)."""
    if stats.count == 0:
        return ""
    if stats.count == 1:
        return f"{stats.mean:.2e} [1]"
    return f"{stats.mean:.2e} ± {stats.std:.2e} [{stats.count}]"


def table_line(label: str, time: str, gpu: str, memory: str) -> str:
    """One line of the table: 22-character label, then three 25-character cells, padded
    to 106 characters as the reference pads them (a diff against its block is empty)."""
    return f"{label:<22} | {time:<25} | {gpu:<25} | {memory:<25}"


def _header() -> str:
    return f"{'Phase':^22} | {'Time (s)':^25} | {'GPU Time (s)':^25} | {'GPU Max Memory (MB)':^25}"


def _stored(agg: RankAggregator, phase: int, attribute: str) -> np.ndarray:
    """The measured values of ``attribute`` (``wall_s``, ``gpu_s``, ``peak_mib``) of the
    stored rows of ``phase``, in row order (from the writers' cache: rowtext.py)."""
    values = getattr(rowtext.texts(agg, phase), attribute)
    return values[~np.isnan(values)]


def _phase_lines(agg: RankAggregator, rows: Sequence[wire.PhaseDef], on_gpu: bool) -> list[str]:
    out = []
    for row in rows:
        time = (
            [agg.training_s()]
            if row.phase == wire.TRAINING and agg.sessions
            else _stored(agg, row.phase, "wall_s")
        )
        gpu = mem = ""
        if on_gpu and row.gpu:
            gpu, mem = (
                cell(_stored(agg, row.phase, "gpu_s")),
                cell(_stored(agg, row.phase, "peak_mib")),
            )
        out.append(table_line(" " * row.indent + row.summary_label, cell(time), gpu, mem))
    return out


def throughput(agg: RankAggregator, loop_phase: int) -> float | None:
    """Samples per second over the stored rows of ``loop_phase`` (a loop) of known batch
    size: their samples over their summed seconds (None: no such row). The figure of the
    summary's ``Throughput:`` line, unrounded."""
    rows = rowtext.texts(agg, loop_phase)
    wall_s = sum(rows.known_wall_s)
    return rows.samples / wall_s if rows.known_wall_s and wall_s > 0 else None


def _throughput_lines(
    agg: RankAggregator, loop_phase: int, gpu_phases: Sequence[int], on_gpu: bool
) -> list[str]:
    """Samples in the stored loop rows of known batch size over their summed time: each
    row holds the sizes of the batches its step really held, added up (a short last
    accumulation step, or a short batch inside one, counts its own, docs/contract.md,
    Files); GPU throughput: the mean samples per stored step over the mean GPU seconds of
    the ``gpu_phases`` added up."""
    rows = rowtext.texts(agg, loop_phase)
    if not rows.lines:
        return ["Throughput: no measurement"]
    known = len(rows.known_wall_s)
    rate = throughput(agg, loop_phase)
    if rate is None:
        return ["Throughput: unknown (batch size not given and not readable from the batches)"]
    samples = rows.samples
    out = [f"Throughput: {rate:.2f} images/s"]
    if known < len(rows.lines):
        out[0] += f" (over the {known} of {len(rows.lines)} iterations of known batch size)"
    if on_gpu:
        gpu_means = [_stored(agg, p, "gpu_s").tolist() for p in gpu_phases]
        gpu_s = sum(statistics.fmean(v) for v in gpu_means if v)
        if gpu_s > 0:
            out.append(f"GPU throughput: {samples / known / gpu_s:.2f} images/s")
    return out


def _worker_lines(ranks: Sequence[RankAggregator]) -> list[str]:
    """The phases timed inside DataLoader worker processes, which cannot be measured."""
    count = sum(s.worker_phases for agg in ranks for s in agg.sessions)
    if not count:
        return []
    return [
        f"{count} phases inside DataLoader workers were not measured (a worker process "
        "cannot send; time them in the main process)"
    ]


def _gpu_unfinished_lines(ranks: Sequence[RankAggregator]) -> list[str]:
    """The phases whose GPU time was lost at finish: the GPU was still running the work
    queued before them when the markers' bounded wait (GPU_DRAIN_S) ended."""
    count = sum(s.gpu_unfinished for agg in ranks for s in agg.sessions)
    if not count:
        return []
    return [
        f"{count} phases at the end of the run have no GPU time: the GPU was still "
        f"running work queued before them when the wait at finish ended "
        f"({GPU_DRAIN_S:g} s); they count among the GPU times not measured"
    ]


def _streaming_line(label: str, series: PhaseSeries) -> str:
    return f"{label:<22} | {welford_cell(series.wall):<36} | {welford_cell(series.gpu)}".rstrip()


def _streaming_lines(agg: RankAggregator) -> list[str]:
    """Every post-warmup measurement, past the cap: two wider cells (counts grow large)."""
    out = [
        "All post-warmup measurements (streaming; the table above shows the stored rows):",
        f"{'Phase':^22} | {'Time (s)':^36} | {'GPU Time (s)':^36}".rstrip(),
    ]
    for row in wire.PHASES[1:]:  # every phase but Training (its time is the account)
        series = agg.series.get(row.phase)
        if series is not None and series.wall.count:
            out.append(_streaming_line(" " * row.indent + row.summary_label, series))
    for phase in agg.measured_custom():
        out.append(_streaming_line(agg.custom_names[phase], agg.series[phase]))
    return out


def _custom_lines(agg: RankAggregator, on_gpu: bool) -> list[str]:
    custom = agg.measured_custom()
    if not custom:
        return []
    out = ["Custom phases (stored rows):"]
    for phase in custom:
        gpu = cell(_stored(agg, phase, "gpu_s")) if on_gpu else ""
        mem = cell(_stored(agg, phase, "peak_mib")) if on_gpu else ""
        out.append(
            table_line(agg.custom_names[phase], cell(_stored(agg, phase, "wall_s")), gpu, mem)
        )
    return out


def _framework_loop_lines(agg: RankAggregator, sessions: int) -> list[str]:
    """Training against the framework's own clock of its training loop (the Trainer's
    ``train_runtime``), when its callback sent the loop's start and end."""
    loop = agg.framework_loop_s()
    if loop is None:
        return []
    training_s, inside_s, before_s, after_s, counted = loop
    which = "" if counted == sessions else f" (the {counted} of {sessions} sessions that sent it)"
    return [
        f"Training {training_s:.2f} s{which} = the framework's own training loop "
        f"{inside_s:.2f} s (its clock: the Trainer's train_runtime)",
        f"  + {before_s:.2f} s before that loop began (the script and the framework's "
        "set-up after start_run: model, data loaders, preparation)",
        f"  + {after_s:.2f} s after it ended (its final log, loading the best model, "
        "removing old checkpoints)",
    ]


def time_lines(agg: RankAggregator, gaps: Sequence[tuple[float, float]]) -> list[str]:
    """The Training time account of rank ``agg``: the effective time (the Training row),
    the wall time including downtime between processes and work redone after a resume from
    a checkpoint, and each gap during which no sidecar saved the run's records (seconds
    since the run started).
    """
    sessions = len(agg.sessions)
    # the wall time, downtime and redone work of the goodput account: one figure each in
    # every block and file
    account = agg.goodput_account()
    training_s = agg.training_s()
    downtime_s, redone_s = account.badput_s["downtime"], account.badput_s["redone"]
    before_s = max(0.0, account.wall_s - training_s - downtime_s - redone_s)
    out = [
        f"Training time: effective {training_s:.2f} s over {sessions} "
        f"session{'s' if sessions != 1 else ''}; wall {account.wall_s:.2f} s",
        f"  including downtime {downtime_s:.2f} s and redone work {redone_s:.2f} s "
        "(work after the last checkpoint, done again on resume)",
        f"  and the processes' time before start_run {before_s:.2f} s",
        *_framework_loop_lines(agg, sessions),
    ]
    for start, end in gaps:
        out.append(
            f"Sidecar gap: from {start - agg.run_start_unix:.2f} s to "
            f"{end - agg.run_start_unix:.2f} s no sidecar saved this run's records "
            "(the sidecar was gone; the run went on)"
        )
    return out


def computational_block(
    ranks: Sequence[RankAggregator],
    gpu_names: Sequence[str],
    gaps: Sequence[tuple[float, float]],
    resource_lines: Sequence[str],
    rank_lines: Sequence[str] = (),
    goodput_lines: Sequence[str] = (),
) -> list[str]:
    """All lines of our blocks (see the module docstring): the reference's block for
    rank 0 (``ranks[0]``), our additions (with ``rank_lines``: every rank of the split,
    ``sinks/ranks_text.py``), ``goodput_lines`` (the Goodput block, with its own title and
    star lines), then ``resource_lines`` (the resources block, which starts
    with the line ``Resources``) and a closing star line.
    """
    agg = ranks[0]
    on_gpu = bool(gpu_names)
    lines = [TITLE_LINE, ""]
    if on_gpu:
        lines += ["GPU: " + " then ".join(f"'{name}'" for name in gpu_names), ""]
    lines += [_header(), DASHES]
    lines += _phase_lines(agg, layout.TRAIN_ROWS, on_gpu)
    lines += [
        "",
        *_throughput_lines(agg, wire.TRAINING_LOOP, layout.TRAIN_GPU_PHASES, on_gpu),
        DASHES,
    ]
    lines += _phase_lines(agg, layout.VAL_ROWS, on_gpu)
    lines += [
        "",
        *_throughput_lines(agg, wire.VALIDATION_LOOP, layout.VAL_GPU_PHASES, on_gpu),
        STARS,
    ]
    lines += ["", ADDITIONS_LINE]
    parts = [
        part
        for part in (
            time_lines(agg, gaps),
            _streaming_lines(agg),
            _custom_lines(agg, on_gpu),
            list(rank_lines),
            _worker_lines(ranks),
            _gpu_unfinished_lines(ranks),
        )
        if part
    ]
    for i, part in enumerate(parts):
        lines += [*([""] if i else []), *part]
    lines += [STARS]
    if goodput_lines:
        lines += ["", *goodput_lines]
    lines += ["", *resource_lines, STARS]
    return lines


def replace_block(existing: str, block: Sequence[str]) -> str:
    """``existing`` with our previous blocks (the reference block's title line to the
    closing star line after ``Resources``) replaced by ``block``; text that is not ours is
    kept. Without a previous block, ours is appended.
    """
    lines = existing.splitlines()
    new = list(block)
    if TITLE_LINE not in lines:
        prefix = [*lines, ""] if lines and lines[-1].strip() else lines
        return "\n".join([*prefix, *new]) + "\n"
    start = lines.index(TITLE_LINE)
    end = len(lines)
    if RESOURCES in lines[start:]:
        resources = lines.index(RESOURCES, start)
        end = next((i + 1 for i in range(resources, len(lines)) if lines[i] == STARS), end)
    return "\n".join([*lines[:start], *new, *lines[end:]]) + "\n"
