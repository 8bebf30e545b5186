"""A real multi-node job (docs/multi-node.md): two network namespaces with their own
hostnames act as two nodes, one shared folder, ``torchrun --nnodes 2 --nproc-per-node 2``
over gloo training a small DDP model on the CPU, each node under its own sidecar
(``sidecar run -- torchrun ...``, or a node daemon ``sidecar serve`` per namespace).

Checked: every rank's rows match its own clock, a rank slowed on purpose is named with its
host and phase, and a node killed mid-run (its sidecar and job) leaves its ranks
``incomplete`` with the cause while the other node keeps every row.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

from tests.e2e.test_multi_node import (
    FORWARD_S,
    JOB,
    SLOW_RANK,
    SLOW_S,
    WARMUP,
    check_ranks_match_their_clocks,
    check_straggler,
)
from tests.support import netns
from tests.support.helpers import SAME_PRIORITY, env, read_tsv, run_json, split_dir, wait_for

pytestmark = pytest.mark.skipif(bool(netns.unavailable()), reason=str(netns.unavailable()))

ITERS = 20


def _torchrun(
    node: netns.Node, master: netns.Node, rank: int, port: int, truth: Path, iters: int = ITERS
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        master.address,
        "--master-port",
        str(port),
        str(JOB),
        "--ddp",
        "--truth",
        str(truth),
        "--iters",
        str(iters),
        "--warmup",
        str(WARMUP),
        "--forward-s",
        str(FORWARD_S),
        "--slow-rank",
        str(SLOW_RANK),
        "--slow-s",
        str(SLOW_S),
    ]


def _under_run(
    node: netns.Node, command: Sequence[str], cwd: Path, *extra: str
) -> subprocess.Popen[str]:
    return node.popen(
        [sys.executable, "-m", "sidecar", "run", *SAME_PRIORITY, *extra, "--", *command],
        env(OMP_NUM_THREADS="1"),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _truth_iterations(truth: Path, rank: int) -> int:
    try:
        return len(json.loads((truth / f"rank{rank}.json").read_text())["forward_s"])
    except (FileNotFoundError, ValueError):
        return 0


def test_torchrun_on_two_nodes_each_under_its_sidecar(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    with netns.nodes() as (node0, node1):
        runs = [
            _under_run(node, _torchrun(node, node0, rank, 29541, truth), short_tmp)
            for rank, node in enumerate((node0, node1))
        ]
        outputs = [run.communicate(timeout=240)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    folder = short_tmp / "maps"
    error_s = check_ranks_match_their_clocks(folder, truth, range(4), ITERS)
    print(f"largest median error of a rank against its own clock: {error_s * 1e6:.0f} µs")
    entry = run_json(folder)["splits"]["0"]
    assert entry["hosts"] == {"node0": [0, 1], "node1": [2, 3]}, entry
    assert entry["status"] == "completed", entry
    summary = (split_dir(folder) / "summary.log").read_text()
    margin_s = check_straggler(summary, "node1")
    print(f"straggler margin found across namespaces: {margin_s:.4f} s")
    waited = re.search(r"^Nodes: waited ([0-9.]+) s", summary, re.M)
    assert waited, summary
    print(f"time the bounded wait added at the end: {waited[1]} s")
    assert "Host node1 (ranks 2, 3" in summary


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (a node going down)."""
    parent = psutil.Process(pid)
    for process in [*parent.children(recursive=True), parent]:
        process.kill()


def _node_iterations(folder: Path, host: str) -> int:
    """The stored iterations of ``host``'s ranks in its node file (0 before it has one)."""
    for path in (split_dir(folder) / "nodes").glob("*.json"):
        try:
            node = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if node["host"] == host:
            return min((rank["iterations"] for rank in node["ranks"]), default=0)
    return 0


def test_a_node_killed_mid_run_leaves_its_ranks_incomplete(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    with netns.nodes() as (node0, node1):
        runs = [
            _under_run(
                node,
                _torchrun(node, node0, rank, 29542, truth, 400),
                short_tmp,
                "--nodes-wait",
                "3",
            )
            for rank, node in enumerate((node0, node1))
        ]
        wait_for(
            lambda: _node_iterations(short_tmp / "maps", "node1") > 0,
            180,
            "node1's figures of measured iterations",
        )
        _kill_tree(runs[1].pid)
        outputs = [run.communicate(timeout=240)[0] for run in runs]
    folder = short_tmp / "maps"
    for rank in (0, 1):  # the surviving node keeps every row its ranks finished
        name = "computational.tsv" if rank == 0 else f"computational-rank{rank}.tsv"
        rows = read_tsv(split_dir(folder) / "logs" / name)["Forward (s)"].dropna()
        assert len(rows) >= _truth_iterations(truth, rank) - WARMUP - 1, (rank, outputs[0])
    summary = (split_dir(folder) / "summary.log").read_text()
    for rank in (2, 3):
        assert re.search(
            rf"^Rank {rank} on node1: incomplete \(node node1 sent no final "
            r"figures within 3 s",
            summary,
            re.M,
        ), summary
    entry = run_json(folder)["splits"]["0"]
    assert entry["status"] in ("incomplete", "failed"), entry
    dead = next(n for n in entry["nodes"] if n["node_host"] == "node1")
    assert dead["status"] == "incomplete" and "node1" in dead["cause"], dead


def test_torchrun_on_two_nodes_under_node_daemons(short_tmp: Path) -> None:
    truth = short_tmp / "truth"
    truth.mkdir()
    root = short_tmp / "root"
    root.mkdir()
    with netns.nodes() as (node0, node1):
        daemons = [
            node.popen(
                [
                    sys.executable,
                    "-m",
                    "sidecar",
                    "serve",
                    *SAME_PRIORITY,
                    "--endpoint",
                    f"ipc://{short_tmp}/{node.hostname}.sock",
                    "--root",
                    str(root),
                ],
                env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for node in (node0, node1)
        ]
        try:
            wait_for(
                lambda: all((short_tmp / f"{n.hostname}.sock").exists() for n in (node0, node1)),
                60,
                "the node daemons",
            )
            jobs = [
                node.popen(
                    _torchrun(node, node0, rank, 29543, truth),
                    env(
                        OMP_NUM_THREADS="1",
                        SIDECAR_ENDPOINT=f"ipc://{short_tmp}/{node.hostname}.sock",
                    ),
                    cwd=short_tmp,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for rank, node in enumerate((node0, node1))
            ]
            outputs = [job.communicate(timeout=240)[0] for job in jobs]
            assert [job.returncode for job in jobs] == [0, 0], outputs
            folder = root / "maps"
            wait_for(
                lambda: (
                    run_json(folder).get("splits", {}).get("0", {}).get("status") == "completed"
                    and "Nodes: waited" in (split_dir(folder) / "summary.log").read_text()
                ),
                60,
                "the final summary",
            )
        finally:
            for daemon in daemons:
                daemon.terminate()
                daemon.wait(30)
    check_ranks_match_their_clocks(folder, truth, range(4), ITERS)
    check_straggler((split_dir(folder) / "summary.log").read_text(), "node1")
    assert run_json(folder)["splits"]["0"]["hosts"] == {"node0": [0, 1], "node1": [2, 3]}
