"""One split, many sidecars (docs/multi-node.md): every rank of a job is measured whichever
sidecar serves it, each rank's rows match its own clock, and the sidecar serving rank 0
writes one summary for the split, naming the straggler and the ranks that never came.

Here on one host: two ``sidecar run`` for one 4-rank job (ranks 0-1 and 2-3), as two nodes
would run it. The namespaces test (tests/e2e/test_multi_node_netns.py) does the same
across two hosts with torchrun.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.fake_pynvml import RANK_GPUS
from tests.support.helpers import (
    SAME_PRIORITY,
    env,
    read_tsv,
    run_json,
    sidecar_command,
    split_dir,
    wait_for,
)

JOB = Path(__file__).resolve().parents[1] / "support" / "jobs" / "ranks_job.py"
WARMUP = 2
ITERS = 20
FORWARD_S = 0.002
SLOW_S = 0.03
SLOW_RANK = 2  # its data loading is slowed on purpose (rank 3's forward is the longest)
ROUNDING_S = 1e-4  # far above the rounding of stored rows, far below a forward's 2 ms


def _ranks_job(ranks: str, truth: Path, slow_s: float) -> list[str]:
    """``ranks_job.py`` for ``ranks`` of the 4-rank job, rank ``SLOW_RANK`` slowed by
    ``slow_s`` seconds of data loading, each rank's clock in ``truth``."""
    return [
        sys.executable,
        str(JOB),
        "--spawn",
        ranks,
        "--world",
        "4",
        "--truth",
        str(truth),
        "--iters",
        str(ITERS),
        "--warmup",
        str(WARMUP),
        "--forward-s",
        str(FORWARD_S),
        "--slow-rank",
        str(SLOW_RANK),
        "--slow-s",
        str(slow_s),
    ]


def _node(
    cwd: Path,
    truth: Path,
    ranks: str,
    *extra: str,
    seams: Sequence[str] = (),
    job: Sequence[str] = (),
    slow_s: float = SLOW_S,
) -> subprocess.Popen[str]:
    """``sidecar run -- ranks_job.py --spawn RANKS`` (one node of the 4-rank job), the
    sidecar with test ``seams`` (``tests.support.launcher``), the job with ``job``
    options more."""
    return subprocess.Popen(
        [
            *sidecar_command(
                "run",
                *SAME_PRIORITY,
                *extra,
                seams=seams,
            ),
            "--",
            *_ranks_job(ranks, truth, slow_s),
            *job,
        ],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def check_ranks_match_their_clocks(
    folder: Path, truth: Path, ranks: range, iters: int = ITERS
) -> float:
    """Every rank's stored Forward rows against the forward times it took itself; returns
    the median error (s) of the rank where it is largest.

    The rank's own clock runs around the phase, so it never reads less than the row
    (up to the rows' rounding); it reads more by the cost of entering and leaving the
    phase, which a loaded machine stretches by milliseconds now and then. Rank r's forward
    lasts (r + 1) × 2 ms: another rank's rows are 2 ms or more longer (then a row exceeds
    the clock) or shorter (then the median is off by 2 ms)."""
    worst_s = 0.0
    for rank in ranks:
        name = "computational.tsv" if rank == 0 else f"computational-rank{rank}.tsv"
        rows = read_tsv(split_dir(folder) / "logs" / name)["Forward (s)"].dropna().tolist()
        own = json.loads((truth / f"rank{rank}.json").read_text())["forward_s"][WARMUP:]
        assert len(rows) == len(own) == iters - WARMUP, (rank, len(rows), len(own))
        errors = [clock - row for row, clock in zip(rows, own, strict=True)]
        assert min(errors) > -ROUNDING_S, (rank, min(errors))
        assert statistics.median(errors) < FORWARD_S / 2, (rank, errors)
        worst_s = max(worst_s, statistics.median(errors))
    return worst_s


def check_straggler(summary: str, host: str) -> float:
    """The ``Straggler:`` line names SLOW_RANK on ``host`` in data loading; its margin (s)."""
    match = re.search(
        rf"^Straggler: rank {SLOW_RANK} on (\S+), data loading, "
        r"\+([0-9.e+-]+) s",
        summary,
        re.M,
    )
    assert match, summary
    assert match[1] == host
    margin_s = float(match[2])
    assert SLOW_S / 2 < margin_s < SLOW_S * 3, margin_s
    return margin_s


def test_two_sidecars_on_one_host_measure_every_rank_of_one_split(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    nodes = [_node(short_tmp, truth, "0,1"), _node(short_tmp, truth, "2,3")]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "refused" not in "".join(outputs), outputs
    folder = short_tmp / "maps"
    error_s = check_ranks_match_their_clocks(folder, truth, range(4))
    print(f"largest median error of a rank against its own clock: {error_s * 1e6:.0f} µs")
    entry = run_json(folder)["splits"]["0"]
    assert entry["ranks"] == [0, 1, 2, 3]
    assert entry["status"] == "completed", entry
    assert len(entry["nodes"]) == 2
    assert sorted(sorted(n["ranks"]) for n in entry["nodes"]) == [[0, 1], [2, 3]]
    assert entry["hosts"] == {socket.gethostname(): [0, 1, 2, 3]}
    summary = (split_dir(folder) / "summary.log").read_text()
    margin_s = check_straggler(summary, socket.gethostname())
    print(f"straggler margin found: {margin_s:.4f} s (slowed by {SLOW_S} s)")
    # CPU ranks: the GPU line says so, and no GPU figure is made up anywhere
    gpu_line = f"Straggler GPU: none (rank {SLOW_RANK} reported no GPU: its figures are CPU only)"
    assert gpu_line in summary.splitlines(), summary
    waited = re.search(r"^Nodes: waited ([0-9.]+) s", summary, re.M)
    assert waited, summary
    print(f"time the bounded wait added at the end: {waited[1]} s")
    assert "Ranks missing" not in summary
    table = read_tsv(split_dir(folder) / "logs" / "ranks.tsv")
    assert table["rank"].tolist() == [0, 1, 2, 3]
    assert table["iterations"].tolist() == [ITERS - WARMUP] * 4
    assert table.set_index("rank").loc[SLOW_RANK, "phase"] == "data loading"
    assert table["gpu samples"].isna().all() and table["throttle reasons"].isna().all()
    # the report: one job for the split of two sidecars, with its straggler
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar",
            "report",
            str(folder),
            "--out",
            str(short_tmp / "report"),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    jobs = read_tsv(short_tmp / "report" / "jobs.tsv")
    assert len(jobs) == 1
    assert (
        jobs.loc[0, "straggler rank"],
        jobs.loc[0, "straggler host"],
        jobs.loc[0, "straggler phase"],
    ) == (SLOW_RANK, socket.gethostname(), "data loading")
    assert jobs.loc[0, ["straggler SM clock (MHz)", "straggler power (W)"]].isna().all()


def test_the_stragglers_throttled_gpu_is_shown_beside_its_line(short_tmp: Path) -> None:
    """Each rank reports its GPU; the fake NVML of both sidecars holds rank 2's at 900 MHz,
    88 °C and 120 W, throttled, the others at 1980 MHz, 60 °C and 300 W. Rank 2 is slowed
    by 0.1 s an iteration, so rounds every 0.2 s fall inside its iterations."""
    truth = short_tmp / "truth"
    truth.mkdir()
    seams = ["--fake-nvml", "rank_gpus_third_throttled"]
    job = ["--gpu-uuids", ",".join(RANK_GPUS)]
    nodes = [
        _node(short_tmp, truth, part, "--interval", "0.2", seams=seams, job=job, slow_s=0.1)
        for part in ("0,1", "2,3")
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    summary = (split_dir(short_tmp / "maps") / "summary.log").read_text()
    line = re.search(
        rf"^Straggler GPU: rank {SLOW_RANK} in its \d+ slowest iterations \((\d+) samples\): "
        r"SM clock median 900 MHz \(min 900\), power mean 120\.0 W, temperature max 88 °C, "
        r"throttle reasons hw_slowdown \(100 %\), hw_thermal_slowdown \(100 %\); "
        r"the other ranks' GPUs then \((\d+) samples\): SM clock median 1980 MHz \(min 1980\), "
        r"power mean 300\.0 W, temperature max 60 °C, throttle reasons none$",
        summary,
        re.M,
    )
    assert line, summary
    print(f"samples inside the straggler's slowest iterations: {line[1]}, the others': {line[2]}")
    table = read_tsv(split_dir(short_tmp / "maps") / "logs" / "ranks.tsv").set_index("rank")
    assert table.loc[SLOW_RANK, "sm clock median (MHz)"] == 900
    assert (
        table.loc[SLOW_RANK, "throttle reasons"] == "hw_slowdown 1.000, hw_thermal_slowdown 1.000"
    )


def test_a_node_that_never_wrote_is_named_and_the_wait_is_bounded(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    node = _node(short_tmp, truth, "0,1", "--nodes-wait", "2")
    output = node.communicate(timeout=240)[0]
    assert node.returncode == 0, output
    folder = short_tmp / "maps"
    summary = (split_dir(folder) / "summary.log").read_text()
    assert "Ranks missing: 2, 3 of 4 (no figures from their node)" in summary, summary
    waited = float(re.search(r"^Nodes: waited ([0-9.]+) s", summary, re.M)[1])
    assert 2.0 <= waited < 10.0, waited
    entry = run_json(folder)["splits"]["0"]
    assert entry["status"] == "incomplete"
    assert "ranks 2, 3 sent no figures within 2 s" in entry["cause"]
    [theirs] = [node for node in entry["nodes"] if node["ranks"] == [2, 3]]
    assert theirs["status"] == "incomplete" and theirs["cause"] == entry["cause"]
    assert entry["ranks"] == [0, 1, 2, 3] and entry["end_unix"] is not None


# The second node must claim its rank inside the first's 5 s wait: under the other tests'
# load its start (torch's import) can take longer.
@pytest.mark.alone
def test_the_same_rank_on_a_second_sidecar_is_refused(short_tmp: Path) -> None:
    """One writer per split and rank: two sidecars may share a split, not a rank (the
    first holds its ranks' claims through its bounded wait for ranks 2 and 3)."""
    truth = short_tmp / "truth"
    truth.mkdir()
    nodes = [_node(short_tmp, truth, ranks, "--nodes-wait", "20") for ranks in ("0,1", "1")]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert "one writer per split and rank" in "".join(outputs), outputs


def test_a_resume_of_both_nodes_continues_every_rank(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    for extra in ((), ("--resume",)):
        nodes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sidecar",
                    "run",
                    *SAME_PRIORITY,
                    "--",
                    sys.executable,
                    str(JOB),
                    "--spawn",
                    ranks,
                    "--world",
                    "4",
                    "--truth",
                    str(truth),
                    "--iters",
                    "6",
                    "--warmup",
                    "1",
                    *extra,
                ],
                cwd=short_tmp,
                env=env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for ranks in ("0,1", "2,3")
        ]
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [0, 0], outputs
        assert "afresh" not in "".join(outputs), outputs
    folder = short_tmp / "maps"
    entry = run_json(folder)["splits"]["0"]
    assert entry["ranks"] == [0, 1, 2, 3] and entry["sessions"] == 2, entry
    for rank in range(4):
        name = "phases.tsv" if rank == 0 else f"phases-rank{rank}.tsv"
        phases = read_tsv(split_dir(folder) / "logs" / name)
        assert set(phases["session"]) == {0, 1}, (rank, set(phases["session"]))
        assert set(phases["rank"]) == {rank}


def test_plain_processes_each_with_its_private_sidecar(short_tmp: Path) -> None:
    """``python train.py`` per rank, no sidecar started: each process starts its own
    private one, and the four of them make one split."""
    truth = short_tmp / "truth"
    truth.mkdir()
    job = subprocess.run(
        _ranks_job("0,1,2,3", truth, SLOW_S),
        cwd=short_tmp,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert job.returncode == 0, job.stderr
    folder = short_tmp / "maps"
    summary_path = split_dir(folder) / "summary.log"
    # rank 0's private sidecar writes the last summary once the other three are final
    wait_for(
        lambda: summary_path.exists() and "Nodes: waited" in summary_path.read_text(),
        60,
        "the final summary",
    )
    check_ranks_match_their_clocks(folder, truth, range(4))
    entry = run_json(folder)["splits"]["0"]
    assert entry["ranks"] == [0, 1, 2, 3] and len(entry["nodes"]) == 4, entry
    check_straggler(summary_path.read_text(), socket.gethostname())
