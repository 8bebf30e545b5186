"""The GPU data path end to end on a CPU machine: the real GpuTimer over the fake CUDA
backend (or the real TorchCudaBackend over ``FakeCuda``, a GPU that runs behind the host)
in the training process, real sockets, a real sidecar process, real files. Checks the
units (seconds, MiB), the GPU lines of the summary, the GPU identity, the device timed,
that nothing waits for the GPU, and graph capture.
"""

from __future__ import annotations

import json
import re
import sys
import time
import types

import pytest
import torch  # also: the markers look for CUDA only in a script that uses torch

import markers
import markers.buffer
import markers.gpu
from markers.buffer import FLUSH_AGE_NS
from markers.cuda import format_uuid
from tests.support.fake_cuda import FakeBackend, FakeCuda, FakeEvent, fake_torch
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
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        markers.gpu, "open_gpu_timer", lambda **_: markers.gpu.GpuTimer(CompletingBackend(), 64)
    )
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
    assert re.fullmatch(
        r"   Forward +\| \S+ ± \S+ \[9\] +\| 7\.50e-04 ± 0\.00e\+00 \[9\] +\| "
        r"3\.00e\+02 ± 0\.00e\+00 \[9\] *",  # padded to 106, as the reference pads it
        forward,
    )
    document = json.loads((sidecar.root / "maps" / "run.json").read_text())
    assert document["gpus"] == [{"uuid": CompletingBackend.device_uuid, "name": "Fake GPU"}]


def test_phases_the_event_pool_could_not_time_are_counted_in_the_summary(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One event pair for three phases per step: the pool runs dry until a flush frees it.
    monkeypatch.setattr(
        markers.gpu, "open_gpu_timer", lambda **_: markers.gpu.GpuTimer(CompletingBackend(), 1)
    )
    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=8) as run:
        for _batch in run.train_batches([[0] * 8] * 20):
            for phase in ("forward", "backward", "optimization"):
                with run.phase(phase):
                    pass
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    summary = (sidecar.split_dir() / "summary.log").read_text()
    match = re.search(r"^GPU times not measured: (\d+) phases$", summary, re.M)
    assert match is not None
    untimed = sum(
        int(frame[f"{p} (s)"].notna().sum() - frame[f"{p} GPU (s)"].notna().sum())
        for p in ("Forward", "Backward", "Optimization")
    )
    assert untimed > 0 and int(match[1]) == untimed  # every step is stored (cap 100)


def test_a_loop_on_a_gpu_that_runs_behind_never_waits_and_times_the_models_device(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDP-style: the model on cuda:1 without set_device (current device 0); every forward
    queues 0.3 s of GPU work. The host must go through the loop without waiting, the
    GPU times must be the GPU's, and device 1 must be the one timed and named."""
    cuda = FakeCuda(["Fake A", "Fake B"], current=0)
    cuda.alloc(200 * MIB, device=1)  # model.to("cuda:1")
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=8) as run:
        t0 = time.perf_counter()
        for _batch in run.train_batches([[0] * 8] * 3):
            with run.phase("forward"):
                cuda.launch(0.3, device=1)
            with run.phase("backward"):
                cuda.launch(0.01, device=1)
        loop_s = time.perf_counter() - t0
    assert loop_s < 0.3  # 0.93 s of GPU work was queued: the markers never waited for it
    assert cuda.syncs == []
    assert {stream.device for _, stream in cuda.records} == {1}
    assert not cuda.devices[0].context  # no context made on the idle GPU 0
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    assert frame["Forward GPU (s)"].sub(0.3).abs().max() < 0.01
    assert (frame["Forward GPU max memory (MB)"] == 200.0).all()  # device 1's allocator
    document = json.loads((sidecar.root / "maps" / "run.json").read_text())
    assert document["gpus"] == [
        {"uuid": format_uuid(types.SimpleNamespace(bytes=cuda.devices[1].uuid)), "name": "Fake B"}
    ]


def test_phases_inside_a_cuda_graph_capture_do_not_break_it(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush falls inside the capture (its age passes there): no event may be
    queried or recorded on the capturing stream; the captured phases are not measured."""
    cuda = FakeCuda(["Fake A"])
    cuda.alloc(MIB)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=8) as run:
        for i, _batch in enumerate(run.train_batches([[0] * 8] * 4)):
            if i == 1:
                with cuda.graph() as graph:  # a capture inside the marked step
                    for _ in range(3):
                        with run.phase("forward"):
                            cuda.launch(0.001)
                            time.sleep(FLUSH_AGE_NS / 2e9)
            else:
                with run.phase("forward"):
                    (graph.replay if i > 1 else cuda.launch)(*(() if i > 1 else (0.002,)))
    assert not cuda.capture_invalidated
    assert all(not event.in_graph for event, _ in cuda.records)
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    assert frame["Forward GPU (s)"].notna().sum() == 3  # iteration 1's forward: not timed
    assert abs(frame["Forward GPU (s)"].iloc[2] - 0.003) < 0.001  # a replay is timed
    summary = (sidecar.split_dir() / "summary.log").read_text()
    assert "GPU times not measured: 3 phases" in summary


def test_the_model_named_by_instrument_or_start_run_decides_the_device(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """instrument(model) hands the model to the run (Run.prefer_device): its parameters'
    device is timed even where another device holds more memory."""
    cuda = FakeCuda(["Fake A", "Fake B"], current=0)
    cuda.alloc(900 * MIB, device=0)
    cuda.alloc(100 * MIB, device=1)
    model = types.SimpleNamespace(
        parameters=lambda: iter([types.SimpleNamespace(device=torch.device("cuda", 1))])
    )
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=8) as run:
        run.prefer_device(model)
        for _batch in run.train_batches([[0] * 8] * 2):
            with run.phase("forward"):
                cuda.launch(0.001, device=1)
    assert {stream.device for _, stream in cuda.records} == {1}
    document = json.loads((sidecar.root / "maps" / "run.json").read_text())
    assert [gpu["name"] for gpu in document["gpus"]] == ["Fake B"]


def test_phases_still_queued_on_the_gpu_when_the_finish_wait_ends_are_said(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop ends with seconds of work queued: the last phases' GPU times do not come
    within the bounded wait at finish (shortened here). They are counted, travel to the
    sidecar and are said in summary.log, and the script gets one warning."""
    cuda = FakeCuda(["Fake A"])
    cuda.alloc(MIB)
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    monkeypatch.setattr(markers.buffer, "GPU_DRAIN_S", 0.2)
    with (
        pytest.warns(RuntimeWarning, match=r"3 phases have no GPU time"),
        markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=8) as run,
    ):
        for _batch in run.train_batches([[0] * 8] * 3):
            with run.phase("forward"):
                cuda.launch(1.0)  # 3 s queued: none of these ends within 0.2 s
    summary = (sidecar.split_dir() / "summary.log").read_text()
    assert re.search(
        r"^3 phases at the end of the run have no GPU time: the GPU was still "
        r"running work queued before them when the wait at finish ended "
        r"\(5 s\)",
        summary,
        re.M,
    ), summary
