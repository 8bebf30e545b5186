"""Dense peak throughput of known NVIDIA GPUs by NVML name and dtype, and the model FLOPs
utilization (MFU) estimate built on it.

Peaks are the vendors' datasheet figures for dense math (no structured sparsity), in
TFLOP/s, on the tensor cores where the dtype uses them (``tf32``, ``bf16``, ``fp16``,
``fp8``) and the CUDA cores for ``fp32``. A name is matched by the first pattern it
contains (case-insensitive), so the more specific patterns come first. Clocks, power
caps and MIG slices change what a device reaches: the MFU is an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

_H100_SXM = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
_A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
# (pattern in the NVML name, peak TFLOP/s by dtype), most specific first
PEAKS_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", _H100_SXM),  # the H100 SXM's compute with more memory
    ("H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.5}),
    ("H100", _H100_SXM),
    ("B200", {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}),
    ("A100", _A100),
    ("A30", {"fp32": 10.3, "tf32": 82.0, "bf16": 165.0, "fp16": 165.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0}),
    ("L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}),
    ("V100", {"fp32": 15.7, "fp16": 125.0}),
    ("T4", {"fp32": 8.1, "fp16": 65.0}),
)


def peak_tflops(gpu_name: str, dtype: str) -> float | None:
    """The dense peak of ``gpu_name`` (as NVML names it) for ``dtype``, TFLOP/s; None for
    a GPU or dtype the table does not know."""
    name = gpu_name.lower()
    for pattern, peaks in PEAKS_TFLOPS:
        if pattern.lower() in name:
            return peaks.get(dtype)
    return None


@dataclass(frozen=True)
class Mfu:
    """An MFU estimate and its inputs: FLOPs per batch (the user's or counted), batches
    per second over the measured steps, the device's peak."""

    flops_per_batch: float
    batches_per_s: float
    gpu_name: str
    dtype: str
    peak_tflops: float | None

    @property
    def achieved_tflops(self) -> float:
        """Model FLOP/s reached, TFLOP/s."""
        return self.flops_per_batch * self.batches_per_s / 1e12

    @property
    def ratio(self) -> float | None:
        """Achieved over peak (0-1); None without a known peak."""
        return self.achieved_tflops / self.peak_tflops if self.peak_tflops else None

    def to_json(self) -> dict[str, object]:
        """As run.json holds it."""
        return {
            "estimate": True,
            "mfu": self.ratio,
            "achieved_tflops": self.achieved_tflops,
            "flops_per_batch": self.flops_per_batch,
            "batches_per_s": self.batches_per_s,
            "gpu": self.gpu_name,
            "dtype": self.dtype,
            "peak_tflops": self.peak_tflops,
        }
