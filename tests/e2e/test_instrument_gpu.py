"""instrument() on a real CUDA device: skipped without one. The hooks never synchronize
(the loop runs under sync debug mode "error") and fill the GPU columns, the Backward
ended by the autograd engine's callback included."""

from __future__ import annotations

import pytest

import markers
from tests.support.helpers import Sidecar, read_tsv

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_instrumented_loop_on_a_gpu_fills_the_gpu_columns(sidecar: Sidecar) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [
        (torch.randn(256, 1024, device="cuda"), torch.randint(0, 10, (256,), device="cuda"))
        for _ in range(20)
    ]
    with markers.start_run(out_dir="maps", warmup_iterations=5) as run:
        markers.instrument(model, optimizer, run)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, y in batches:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    frame = read_tsv(sidecar.split_dir() / "logs" / "computational.tsv")
    for phase in ("Forward", "Backward", "Optimization"):
        assert frame[f"{phase} (s)"].notna().sum() == 15, phase
        assert frame[f"{phase} GPU (s)"].notna().sum() == 15, phase
        assert (frame[f"{phase} GPU max memory (MB)"].dropna() > 0).all(), phase
