"""The whole markers → sidecar path on a real CUDA device: skipped without one.

A marked loop runs under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing
call raises), and the files carry GPU seconds, MiB peaks, the GPU's name and NVML
samples of that GPU.
"""

from __future__ import annotations

import json

import pytest

import markers
from tests.support.helpers import Sidecar, read_tsv

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_marked_loop_on_a_gpu_never_synchronizes_and_fills_the_gpu_columns(
        sidecar: Sidecar) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(256, 1024, device="cuda"),
                torch.randint(0, 10, (256,), device="cuda")) for _ in range(50)]
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
