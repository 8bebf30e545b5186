"""A multi-rank training job for the multi-node tests: each rank runs a short loop with
markers (train_batches and phases) and times its own forward phase with ``perf_counter``
into a truth file ``<truth>/rank<r>.json``, so a test can check that every rank's rows
match its own clock.

Two ways to get ranks:

* ``--spawn 0,1 --world 4``: start one process per listed rank with RANK, LOCAL_RANK and
  WORLD_SIZE set (a plain Python job, no torch: what one node of a 4-rank job runs);
* ``--ddp``: the process is one rank of a torchrun job; a small model is trained with
  DistributedDataParallel over gloo on the CPU, so the all-reduce makes the ranks wait
  for the slowest one.

Rank r's forward lasts about ``(r + 1) × --forward-s`` (its rows differ from every other
rank's); ``--slow-rank R --slow-s S`` adds S seconds of data loading to rank R, from
``--slow-from`` iterations on. Every epoch ends with a checkpoint (``--resume`` goes on
from it). ``--hold-file F``: after its last epoch the rank keeps its run open until F
exists, so a test can look at the live run without racing the loop.
``--gpu-uuids U0,U1,...``: rank r reports using the GPU Ur, as the markers do on
CUDA (the sidecar samples it through the fake NVML of ``--fake-nvml``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import markers


class Batch:
    """A batch with a first dimension, as a tensor has (so its size can be read)."""

    def __init__(self, size: int) -> None:
        self.shape = (size, 4)


def _batches(args: argparse.Namespace, rank: int) -> Iterator[Batch]:
    for index in range(args.iters):
        if rank == args.slow_rank and index >= args.slow_from:
            time.sleep(args.slow_s)  # data loading of the rank slowed on purpose
        yield Batch(args.batch_size)


def _ddp_step(state: dict, run: markers.Run) -> None:
    """Backward and optimization of a tiny DDP model: the all-reduce waits for every rank."""
    with run.phase("backward"):
        state["loss"].backward()
    with run.phase("optimization"):
        state["optimizer"].step()
        state["optimizer"].zero_grad()


def _ddp_forward(state: dict) -> None:
    import torch

    inputs = torch.randn(8, 16)
    state["loss"] = state["model"](inputs).pow(2).mean()


def _ddp_setup() -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01), "dist": dist}


def train(args: argparse.Namespace) -> None:
    """One rank: the loop, its truth file, and (under --ddp) the process group."""
    rank = int(os.environ.get("RANK", "0"))
    state = _ddp_setup() if args.ddp else {}
    run = markers.start_run(
        out_dir=args.out_dir,
        warmup_iterations=args.warmup,
        num_measurements=args.cap,
        train_batch_size=args.batch_size,
        resume=args.resume,
    )
    if args.gpu_uuids:  # what the markers send once the script uses CUDA (none here)
        uuid = args.gpu_uuids.split(",")[rank]
        run._sender.send_control({"type": "gpu", "uuid": uuid, "name": "NVIDIA Fake"})  # type: ignore[union-attr]
    forward_s: list[float] = []
    truth = args.truth / f"rank{rank}.json"
    with run:
        for epoch in range(args.epochs):
            with run.epoch():
                for _ in run.train_batches(_batches(args, rank)):
                    start = time.perf_counter()
                    with run.phase("forward"):
                        time.sleep((rank + 1) * args.forward_s)
                        if args.ddp:
                            _ddp_forward(state)
                    forward_s.append(time.perf_counter() - start)
                    if args.ddp:
                        _ddp_step(state, run)
                    else:
                        with run.phase("backward"):
                            pass
                        with run.phase("optimization"):
                            pass
                    truth.write_text(
                        json.dumps(
                            {
                                "rank": rank,
                                "host": socket.gethostname(),
                                "epochs": epoch,
                                "forward_s": forward_s,
                            }
                        )
                    )
            run.checkpoint()  # the resume state, in the split's folder
        while args.hold_file is not None and not args.hold_file.exists():
            time.sleep(0.05)
    if args.ddp:
        state["dist"].destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="maps")
    parser.add_argument("--truth", type=Path, required=True)
    parser.add_argument("--spawn", help="comma-separated ranks to start, one process each")
    parser.add_argument("--world", type=int, default=1, help="WORLD_SIZE of spawned ranks")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--resume", action="store_true", help="continue from the state")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--forward-s", type=float, default=0.002)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--slow-from", type=int, default=0)
    parser.add_argument("--hold-file", type=Path, help="keep the run open until it exists")
    parser.add_argument("--gpu-uuids", help="comma-separated: the GPU each rank reports")
    args = parser.parse_args()
    if args.spawn is None:
        train(args)
        return
    argv = [a for a in sys.argv[1:] if a != "--spawn" and a != args.spawn]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, *argv],
            env={**os.environ, "RANK": rank, "LOCAL_RANK": str(i), "WORLD_SIZE": str(args.world)},
        )
        for i, rank in enumerate(args.spawn.split(","))
    ]
    sys.exit(max(child.wait() for child in children))


if __name__ == "__main__":
    main()
