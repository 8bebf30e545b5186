"""One rank of a two-process DDP job on CPU (gloo), for the Backward-under-DDP test.

    python ddp_job.py RANK PORT TRUTH.json

Rank 1 is slow: its forward sleeps ``SLOW_S``, so rank 0's all-reduce waits for it inside
DDP's reducer tail (``finalize_backward``, the engine's last callback) of rank 0's
``loss.backward()``. Rank 0 runs ``markers.instrument()`` (the sidecar at
``SIDECAR_ENDPOINT``) and writes its own ``perf_counter`` of each ``loss.backward()`` call
to TRUTH.json; rank 1 is not monitored.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 8
SLOW_S = 0.04  # rank 1's extra forward time: rank 0's all-reduce waits this long


class Net(nn.Module):
    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.slow_s = slow_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.slow_s)
        return self.linear(x)


def main() -> int:
    rank, port, truth_path = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = DistributedDataParallel(Net(SLOW_S if rank == 1 else 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    run = None
    if rank == 0:
        import markers

        run = markers.start_run(out_dir="maps", warmup_iterations=1)
        markers.instrument(model, optimizer, run)
    backward_s = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        start = time.perf_counter()
        loss.backward()
        backward_s.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()
    if run is not None:
        run.finish()
        truth_path.write_text(json.dumps({"backward": backward_s}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
