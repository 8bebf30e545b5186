"""The command line of one node of a multi-node ``torchrun`` (``torch.distributed.run``),
for the tests that run one node per network namespace."""

from __future__ import annotations

import sys
from pathlib import Path


def torchrun(
    master_address: str,
    port: int,
    node_rank: int,
    script: Path | str,
    *args: str,
    nodes: int = 2,
    per_node: int = 2,
) -> list[str]:
    """``torch.distributed.run`` for node ``node_rank`` of ``nodes`` (``per_node``
    processes each), meeting at ``master_address:port``, running ``script ARGS``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", str(nodes), "--nproc-per-node", str(per_node)),
        *("--node-rank", str(node_rank)),
        *("--master-addr", master_address, "--master-port", str(port)),
        str(script),
        *args,
    ]
