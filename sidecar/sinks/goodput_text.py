"""The ``Goodput`` block of ``summary.log`` and the goodput entries of ``run.json``: the
split's wall time as productive training plus badput by cause (``sidecar.model.goodput``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.model.goodput import CAUSE_LABELS, CAUSES, Account
from sidecar.model.peaks import Mfu
from sidecar.sinks import layout

TITLE = " Goodput: where the wall time went "


def _share(part_s: float, wall_s: float) -> str:
    return f"{part_s / wall_s * 100:5.1f} %" if wall_s > 0 else "    - %"


def goodput_lines(
    accounts: Mapping[int, Account], split: Account | None, mfu: Mfu | None = None
) -> list[str]:
    """The block (title line to closing star line) for the ranks' ``accounts`` and
    ``split``, their mean (the model's); [] when no rank has a session yet. Several
    ranks: their mean, then one line per rank; the MFU estimate last when FLOPs per
    batch were given."""
    if not accounts or split is None:
        return []
    ranks = sorted(accounts)
    stars = layout.WIDTH - len(TITLE)
    over = f" (mean over {len(ranks)} ranks)" if len(ranks) > 1 else ""
    lines = [
        "*" * ((stars + 1) // 2) + TITLE + "*" * (stars // 2),
        f"Wall time {split.wall_s:.2f} s from the process start{over}; the parts add up to it",
        f"{'Part':<46} | {'Time (s)':>12} | {'Share':>7}",
        f"{'productive training':<46} | {split.productive_s:>12.2f} | "
        f"{_share(split.productive_s, split.wall_s):>7}",
    ]
    for cause in CAUSES:
        value = split.badput_s[cause]
        lines.append(
            f"{CAUSE_LABELS[cause]:<46} | {value:>12.2f} | {_share(value, split.wall_s):>7}"
        )
    if split.gpu_busy_s is None:
        lines.append("GPU busy: not timed (no GPU time of Forward, Backward, Optimization)")
    else:
        lines.append(
            f"GPU busy during productive training: {split.gpu_busy_s:.2f} s "
            f"({_share(split.gpu_busy_s, split.productive_s).strip()} of it; "
            "GPU time of Forward, Backward, Optimization)"
        )
    if len(ranks) > 1:
        for rank in ranks:
            mine = accounts[rank]
            lines.append(
                f"rank {rank}: productive {_share(mine.productive_s, mine.wall_s)}"
                f" of {mine.wall_s:.2f} s; waited for the slowest rank "
                f"{mine.badput_s['straggler']:.2f} s"
            )
    if mfu is not None:
        lines.append(mfu_line(mfu))
    return [*lines, "*" * layout.WIDTH]


def mfu_line(mfu: Mfu) -> str:
    """The MFU estimate's line in the Goodput block: FLOPs per batch × batches/s, and
    its share of the GPU's dense peak (unknown without a known peak)."""
    achieved = (
        f"{mfu.flops_per_batch:.3e} FLOPs per batch × {mfu.batches_per_s:.2f} "
        f"batches/s = {mfu.achieved_tflops:.1f} TFLOP/s"
    )
    if mfu.ratio is None:
        return (
            f"MFU (estimate): unknown, no peak known for '{mfu.gpu_name}' in "
            f"{mfu.dtype}; {achieved}"
        )
    return (
        f"MFU (estimate): {mfu.ratio * 100:.1f} % = {achieved} of "
        f"{mfu.peak_tflops:.0f} TFLOP/s ('{mfu.gpu_name}', {mfu.dtype} dense peak)"
    )


def goodput_entry(accounts: Mapping[int, Account], split: Account | None) -> dict[str, Any] | None:
    """The ``goodput`` entry of a split in ``run.json``: ``split``, the mean over ranks
    (seconds of wall time), and each rank's; None before any rank has a session."""
    if not accounts or split is None:
        return None
    return {
        "mean": split.to_json(),
        "ranks": {str(r): accounts[r].to_json() for r in sorted(accounts)},
    }
