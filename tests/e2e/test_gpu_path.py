"""The GPU data path end to end on a CPU machine: the real GpuTimer over the fake CUDA
backend in the training process, real sockets, a real sidecar process, real files.
Checks the units (seconds, MiB), the GPU lines of the summary and the GPU identity.
"""

from __future__ import annotations

import json
import re

import pytest
import torch  # noqa: F401  - the markers look for CUDA only in a script that uses torch

import markers
import markers.gpu
from tests.support.fake_cuda import FakeBackend, FakeEvent
from tests.support.helpers import Sidecar, read_tsv

MIB = 1024 * 1024
PHASE_GPU_MS = 0.75


class CompletingBackend(FakeBackend):
    """Every phase takes PHASE_GPU_MS on the fake GPU, which keeps up with the host; the
    allocator holds 300 MiB throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.mem = [300 * MIB, 300 * MIB, 300 * MIB, 0]

    def record(self, event: FakeEvent) -> None:
        super().record(event)
        self.clock_ms += PHASE_GPU_MS  # a phase's end event lands PHASE_GPU_MS after its start
        self.done = self.recorded


def test_gpu_columns_are_seconds_and_mib_and_the_summary_names_the_gpu(
        sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(markers.gpu, "open_gpu_timer",
                        lambda **_: markers.gpu.GpuTimer(CompletingBackend(), 64))
    with markers.start_run(out_dir="maps", warmup_iterations=1, train_batch_size=8) as run:
        for _ in range(2):
            with run.epoch():
                for _batch in run.train_batches([[0] * 8] * 5):
                    for phase in ("forward", "backward", "optimization"):
                        with run.phase(phase):
                            pass
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    for phase in ("Forward", "Backward", "Optimization"):
        gpu = frame[f"{phase} GPU (s)"].dropna()
        assert len(gpu) == 9  # 10 iterations, the first of them warmup
        assert gpu.sub(PHASE_GPU_MS / 1e3).abs().max() < 1e-9
        assert (frame[f"{phase} GPU max memory (MB)"].dropna() == 300.0).all()
    assert frame["Training loop (s)"].notna().sum() == 9
    lines = (sidecar.split_dir() / "summary.log").read_text().splitlines()
    assert "GPU: 'Fake GPU'" in lines
    gpu_throughput = 8 / (3 * PHASE_GPU_MS / 1e3)
    assert f"GPU throughput: {gpu_throughput:.2f} images/s" in lines
    forward = next(line for line in lines if line.startswith("   Forward"))
    assert re.fullmatch(r"   Forward +\| \S+ ± \S+ \[9\] +\| 7\.50e-04 ± 0\.00e\+00 \[9\] +\| "
                        r"3\.00e\+02 ± 0\.00e\+00 \[9\]", forward)
    document = json.loads((sidecar.root / "maps" / "run.json").read_text())
    assert document["gpus"] == [{"uuid": CompletingBackend.device_uuid, "name": "Fake GPU"}]


def test_phases_the_event_pool_could_not_time_are_counted_in_the_summary(
        sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    # One event pair for three phases per step: the pool runs dry until a flush frees it.
    monkeypatch.setattr(markers.gpu, "open_gpu_timer",
                        lambda **_: markers.gpu.GpuTimer(CompletingBackend(), 1))
    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=8) as run:
        for _batch in run.train_batches([[0] * 8] * 20):
            for phase in ("forward", "backward", "optimization"):
                with run.phase(phase):
                    pass
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    summary = (sidecar.split_dir() / "summary.log").read_text()
    match = re.search(r"^GPU times not measured: (\d+) phases$", summary, re.M)
    assert match is not None
    untimed = sum(int(frame[f"{p} (s)"].notna().sum() - frame[f"{p} GPU (s)"].notna().sum())
                  for p in ("Forward", "Backward", "Optimization"))
    assert untimed > 0 and int(match[1]) == untimed  # every step is stored (cap 100)
