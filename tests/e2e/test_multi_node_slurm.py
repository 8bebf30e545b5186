"""The srun launch shape under a real Slurm (Debian's slurmctld, slurmd and munge, started
by the test): ``srun sidecar run -- python train.py``, one sidecar per task, each serving
its one rank of one split (docs/multi-node.md). Every rank is measured, each rank's rows
match its own clock, and the sidecar serving rank 0 names the rank slowed on purpose.
Needs root.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from tests.e2e.test_multi_node import (
    FORWARD_S,
    ITERS,
    JOB,
    SLOW_S,
    WARMUP,
    check_ranks_match_their_clocks,
)
from tests.support import slurm
from tests.support.helpers import REPO, env, run_json, split_dir

pytestmark = pytest.mark.skipif(bool(slurm.unavailable()), reason=str(slurm.unavailable()))

# srun gives each task SLURM_PROCID and SLURM_NTASKS; the job maps them to RANK and
# WORLD_SIZE as a launcher script would.
BATCH = """#!/bin/sh
#SBATCH --ntasks=2
srun --ntasks=2 sh -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS exec {python} -m sidecar \\
    run --nice 0 -- {python} {job} --truth {truth} --iters {iters} --warmup {warmup} \\
    --forward-s {forward_s} --slow-rank 1 --slow-s {slow_s}'
"""


def test_srun_one_sidecar_per_task(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    work = short_tmp / "work"
    work.mkdir()
    script = work / "train.sh"
    script.write_text(
        BATCH.format(
            python=sys.executable,
            job=JOB,
            truth=truth,
            iters=ITERS,
            warmup=WARMUP,
            forward_s=FORWARD_S,
            slow_s=SLOW_S,
        )
    )
    script.chmod(0o755)
    with slurm.slurm(short_tmp / "slurm") as cluster:
        job_id = cluster.sbatch(script, workdir=work, env=env(PYTHONPATH=str(REPO)))
        cluster.wait_gone(job_id, timeout_s=180)
        log = cluster.log()
    folder = work / "maps"
    assert (folder / "run.json").exists(), log
    check_ranks_match_their_clocks(folder, truth, range(2))
    entry = run_json(folder)["splits"]["0"]
    assert entry["ranks"] == [0, 1] and len(entry["nodes"]) == 2, entry
    assert entry["status"] == "completed", entry
    summary = (split_dir(folder) / "summary.log").read_text()
    assert f"Straggler: rank 1 on {socket.gethostname()}, data loading" in summary, summary
