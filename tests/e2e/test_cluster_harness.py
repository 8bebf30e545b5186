"""The cluster the multi-node and Slurm tests run on works by itself: a real Slurm runs a
non-root user's batch job with the TaskProlog's environment and runs the Epilog as root;
two network namespaces with their own hostnames carry one torchrun job over gloo."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import local_users, netns, slurm
from tests.support.helpers import env
from tests.support.torchrun import torchrun

ALL_REDUCE = """
import json, os, socket, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
path = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json")
with open(path, "w") as out:
    json.dump({"host": socket.gethostname(), "sum": value.item(),
               "world": dist.get_world_size()}, out)
dist.destroy_process_group()
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.skipif(
    bool(slurm.unavailable() or local_users.unavailable() or local_users.user_python_unavailable()),
    reason=str(
        slurm.unavailable() or local_users.unavailable() or local_users.user_python_unavailable()
    ),
)
@slurm.ONE_AT_A_TIME
def test_slurm_runs_a_users_job_with_the_task_prolog_and_the_epilog(short_tmp: Path) -> None:
    short_tmp.chmod(0o755)
    site = local_users.readable_markers(short_tmp / "py")
    work = short_tmp / "work"
    work.mkdir(mode=0o777)
    work.chmod(0o777)
    prolog = _script(short_tmp / "task_prolog.sh", "#!/bin/sh\necho export TM_PROBE=told\n")
    epilog = _script(
        short_tmp / "epilog.sh",
        f'#!/bin/sh\necho "$SLURM_JOB_ID $SLURM_JOB_USER $(id -u)" > {work}/epilog.txt\n',
    )
    job = _script(
        short_tmp / "job.sh",
        (
            "#!/bin/sh\n"
            f"PYTHONPATH={site} {local_users.SYSTEM_PYTHON} -c 'import markers' || exit 3\n"
            f'echo "$(id -un) $SLURM_JOB_ID $TM_PROBE" > {work}/job.txt\n'
        ),
    )
    with (
        local_users.local_users(1, tag="s") as (user,),
        slurm.slurm(short_tmp / "slurm", TaskProlog=prolog, Epilog=epilog) as cluster,
    ):
        job_id = cluster.sbatch(job, user=user, workdir=work)
        cluster.wait_gone(job_id)
        assert (work / "job.txt").read_text().split() == [user, str(job_id), "told"], cluster.log()
        assert (work / "epilog.txt").read_text().split() == [str(job_id), user, "0"]


@pytest.mark.skipif(bool(netns.unavailable()), reason=str(netns.unavailable()))
def test_two_namespaces_carry_one_torchrun_job_over_gloo(short_tmp: Path) -> None:
    script = short_tmp / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    with netns.nodes() as (node0, node1):
        runs = [
            node.popen(
                torchrun(node0.address, 29531, rank, script, str(short_tmp)),
                env(OMP_NUM_THREADS="1"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank, node in enumerate((node0, node1))
        ]
        outputs = [run.communicate(timeout=240)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    results = {rank: (short_tmp / f"rank{rank}.json").read_text() for rank in range(4)}
    parsed = {rank: json.loads(text) for rank, text in results.items()}
    assert {
        rank: (value["host"], value["sum"], value["world"]) for rank, value in parsed.items()
    } == {0: ("node0", 6.0, 4), 1: ("node0", 6.0, 4), 2: ("node1", 6.0, 4), 3: ("node1", 6.0, 4)}
