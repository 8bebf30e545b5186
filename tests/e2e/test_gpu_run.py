"""The whole markers → sidecar path on a real CUDA device: skipped without one.

A marked loop runs under ``torch.cuda.set_sync_debug_mode("error")`` (``.item()`` and the
like raise) with ``torch.cuda.synchronize``/``Event.synchronize`` (which that mode does
not check) made to fail, and the files carry GPU seconds, MiB peaks, the GPU's name and
NVML samples of that GPU. A loop whose forwards queue 0.3 s of GPU work each must go
through on the host in a fraction of that: a marker that waited would show.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

import markers
from tests.support.helpers import Sidecar, read_tsv

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_marked_loop_on_a_gpu_never_synchronizes_and_fills_the_gpu_columns(
    sidecar: Sidecar,
) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [
        (torch.randn(256, 1024, device="cuda"), torch.randint(0, 10, (256,), device="cuda"))
        for _ in range(50)
    ]
    run = markers.start_run(out_dir="maps", warmup_iterations=5, train_batch_size=256)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            with run.epoch():
                for x, y in run.train_batches(batches):
                    with run.phase("forward"):
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                    with run.phase("backward"):
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                    with run.phase("optimization"):
                        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    run.finish()  # the bounded wait for the last GPU results happens here, after the loop

    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    for phase in ("Forward", "Backward", "Optimization"):
        gpu_s = frame[f"{phase} GPU (s)"].dropna()
        assert len(gpu_s) == 95  # 100 iterations, 5 of warmup (the cap is 100)
        assert (gpu_s > 0).all() and (gpu_s < 1.0).all()  # seconds, not milliseconds
        assert (frame[f"{phase} GPU max memory (MB)"].dropna() > 1).all()  # MiB
    summary = (sidecar.split_dir() / "summary.log").read_text()
    name = torch.cuda.get_device_name()
    assert f"GPU: '{name}'" in summary
    assert "GPU throughput:" in summary
    document = json.loads((sidecar.root / "maps" / "run.json").read_text())
    assert [gpu["name"] for gpu in document["gpus"]] == [name]


def test_a_loop_queuing_seconds_of_gpu_work_is_not_held_back_by_the_markers(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    cycles = int(sleep_cycles_per_ms() * 300)  # 0.3 s of GPU work
    model = torch.nn.Linear(64, 64).cuda()

    def forbidden(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a synchronizing call")

    run = markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=8, device=model)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", forbidden)
    torch.cuda.set_sync_debug_mode("error")
    t0 = time.perf_counter()
    try:
        for _batch in run.train_batches([[0] * 8] * 5):
            with run.phase("forward"):
                torch.cuda._sleep(cycles)
            with run.phase("backward"):
                torch.cuda._sleep(cycles // 30)
        host_s = time.perf_counter() - t0
    finally:
        torch.cuda.set_sync_debug_mode(0)
        monkeypatch.undo()
    assert host_s < 0.5, f"1.5 s of GPU work held the host {host_s:.2f} s"
    run.finish()
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    # Relative: the clock may move between calibration and loop (boost, thermals).
    assert frame["Forward GPU (s)"].div(0.3).sub(1).abs().max() < 0.15
    assert frame["Backward GPU (s)"].div(0.01).sub(1).abs().max() < 0.25


def sleep_cycles_per_ms(samples: int = 5) -> float:
    """``torch.cuda._sleep`` cycles per GPU millisecond: the median of ``samples`` warm
    measurements (the first, cold one, pays the clocks ramping up and is left out)."""
    torch.cuda.init()
    rates = []
    for _ in range(samples + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()  # calibration, before the loop
        rates.append(20_000_000 / start.elapsed_time(end))
    return statistics.median(rates[1:])
