"""The peak table by NVML name and dtype, the MFU estimate's arithmetic and its line, and
FLOPs counted on a meta-device copy."""

from __future__ import annotations

import pytest

from sidecar.model.peaks import Mfu, peak_tflops
from sidecar.sinks.goodput_text import mfu_line


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta
        ("NVIDIA GeForce GTX 1080", "fp32", None),
    ],
)
def test_peak_by_name_and_dtype(name: str, dtype: str, peak: float | None) -> None:
    assert peak_tflops(name, dtype) == peak


def test_mfu_arithmetic_and_line() -> None:
    mfu = Mfu(2e12, 100.0, "NVIDIA H200", "bf16", 989.4)
    assert mfu.achieved_tflops == pytest.approx(200.0)
    assert mfu.ratio == pytest.approx(200.0 / 989.4)
    assert mfu_line(mfu).startswith("MFU (estimate): 20.2 % = 2.000e+12 FLOPs per batch")
    assert "unknown" in mfu_line(Mfu(2e12, 1.0, "no GPU", "bf16", None))


def test_flops_counted_on_a_meta_copy() -> None:
    torch = pytest.importorskip("torch")
    from markers.flops import count_flops_per_batch

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    flops = count_flops_per_batch(model, torch.zeros(16, 64))
    forward = 2 * 16 * (64 * 32 + 32 * 8)
    # backward: weight gradients of both layers, the input gradient of the second only
    assert flops == forward + 2 * 16 * (64 * 32 + 32 * 8) + 2 * 16 * 32 * 8
    assert next(model.parameters()).device.type == "cpu"  # the model itself untouched
