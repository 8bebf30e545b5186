"""The CUDA side of GPU timing: which device to time, and its events and allocator.

``TorchCudaBackend`` is what ``markers.gpu.GpuTimer`` uses on a real GPU; it only calls
the ``torch`` the training script already imported (this module never imports torch).

Which device (``choose_device``; ``docs/gpu-timing.md`` says why this order):

1. the ``device=`` given to ``start_run``: an index, ``"cuda:N"``, a ``torch.device``, a
   tensor, or a module (the device of its first CUDA parameter);
2. else the device where the process holds allocated memory (the model's parameters and
   the first CUDA tensors live there), the one holding most when several do;
3. else ``LOCAL_RANK`` when it names a visible device (torchrun's one GPU per rank);
4. else ``torch.cuda.current_device()``.

Reading the allocator statistics of a device never creates a CUDA context on it (the
native allocator keeps them on the host; ``cudaMallocAsync`` answers only for devices
it has initialised), so step 2 costs no context on an idle GPU.
"""

from __future__ import annotations

import os
import uuid as _uuid
from typing import Any

ALLOCATOR_ASYNC = "cudaMallocAsync"

# (current, peak, allocated, freed) of the allocator's "allocated_bytes.all", in bytes;
# allocated/freed are -1 where the backend does not keep these cumulative counters.
Memory = tuple[int, int, int, int]


def format_uuid(raw: Any, mig: bool = False) -> str:
    """A device UUID as NVML prints it: ``GPU-`` (``MIG-`` for a MIG instance) + the
    canonical lower-case UUID.

    ``raw`` is ``torch.cuda.get_device_properties(d).uuid``: an object with ``bytes`` (16
    of them) on recent torch, else something whose ``str()`` is the UUID, prefixed or not.
    """
    prefix = "MIG-" if mig else "GPU-"
    data = getattr(raw, "bytes", None)
    if data is not None:
        return prefix + str(_uuid.UUID(bytes=bytes(data)))
    text = str(raw).strip()
    if text.upper().startswith(("GPU-", "MIG-")):
        prefix = "MIG-" if mig else text[:4].upper()
        text = text[4:]
    try:
        return prefix + str(_uuid.UUID(text))
    except ValueError:
        return prefix + text.lower()


def check_device_spec(spec: Any) -> None:
    """Refuse a ``device=`` that can never name a CUDA device (a caller's mistake).

    Accepted: None, an int >= 0, ``"cuda"``/``"cuda:N"``, or an object with ``.type`` and
    ``.index`` (torch.device), ``.device`` (a tensor) or ``.parameters()`` (a module);
    objects are resolved when timing starts. Raises ValueError otherwise.
    """
    if spec is None or hasattr(spec, "parameters") or hasattr(spec, "device"):
        return
    if isinstance(getattr(spec, "type", None), str) and hasattr(spec, "index"):
        return
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return
    if isinstance(spec, str) and (
        spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit())
    ):
        return
    raise ValueError(
        f"start_run: device must be a CUDA device index, 'cuda:N', a "
        f"torch.device, a tensor or a module, got {spec!r}"
    )


def device_index(spec: Any) -> int | None:
    """The CUDA device index ``spec`` names now, or None when it names none (yet): a
    module whose parameters are all on the CPU, a CPU tensor, ``"cuda"`` without index."""
    if spec is None or isinstance(spec, bool):
        return None
    if isinstance(spec, int):
        return spec
    if isinstance(spec, str):
        return int(spec[5:]) if spec.startswith("cuda:") and spec[5:].isdigit() else None
    if hasattr(spec, "parameters"):  # a module (checked first: modules have .type())
        for parameter in spec.parameters():
            index = device_index(parameter.device)
            if index is not None:
                return index
        return None
    if hasattr(spec, "device"):  # a tensor
        return device_index(spec.device)
    if getattr(spec, "type", None) == "cuda":  # a torch.device; "cuda" alone names none
        return spec.index
    return None


def choose_device(cuda: Any, spec: Any = None) -> tuple[int, str]:
    """The device to time and how it was chosen (see the module docstring).

    ``cuda`` is ``torch.cuda``; ``spec`` the ``device=`` of ``start_run``. Returns
    ``(index, reason)``, reason one of ``"argument"``, ``"allocations"``,
    ``"LOCAL_RANK"``, ``"current device"``.
    """
    count = cuda.device_count()
    index = device_index(spec)
    if index is not None and 0 <= index < count:
        return index, "argument"
    held = []
    for device in range(count):
        stats = cuda.memory_stats_as_nested_dict(device)
        current = stats.get("allocated_bytes", {}).get("all", {}).get("current", 0)
        if current > 0:
            held.append((current, -device))
    if held:
        return -max(held)[1], "allocations"
    local_rank = os.environ.get("LOCAL_RANK", "")
    if local_rank.isdigit() and int(local_rank) < count:
        return int(local_rank), "LOCAL_RANK"
    return cuda.current_device(), "current device"


class TorchCudaBackend:
    """CUDA events and allocator statistics of one device, through the imported torch."""

    def __init__(self, torch: Any, device: int, chosen_by: str = "argument") -> None:
        cuda = torch.cuda
        self._cuda = cuda
        self.device = int(device)
        self.chosen_by = chosen_by
        props = cuda.get_device_properties(self.device)
        self.device_name = str(props.name)
        # CUDA names a MIG instance "<GPU> MIG <profile>"; NVML spells its UUID "MIG-...".
        self.device_uuid = format_uuid(props.uuid, mig=" MIG " in f" {self.device_name} ")
        # cudaMallocAsync keeps only current and peak (the driver's view of the pool), not
        # the cumulative allocated/freed counters the exact cases of phase_peak need.
        self.exact_peaks = cuda.get_allocator_backend() != ALLOCATOR_ASYNC
        self._event = cuda.Event
        self._current_stream = cuda.current_stream
        self.capturing = cuda.is_current_stream_capturing
        # Nested stats straight from the allocator, read twice per phase in "bound" mode.
        # No torch call returns fewer counters: the flat torch.cuda.memory_stats() (and
        # max_memory_allocated(), memory_allocated(), built on it) adds a Python flatten
        # and sort of ~150 keys to the same C++ read. The C function itself spares the
        # public wrapper's is_initialized() and device-index checks (timing opens only
        # once CUDA is initialized, on a device index).
        c_module = getattr(torch, "_C", None)
        self._stats = (
            getattr(c_module, "_cuda_memoryStats", None) or cuda.memory_stats_as_nested_dict
        )

    def new_event(self) -> Any:
        """A timing event; torch creates the CUDA event at its first record."""
        return self._event(enable_timing=True)

    def record(self, event: Any) -> None:
        """Record on the current stream of *this* device; never waits. The stream is named
        so that a script on another current device cannot move our events there."""
        event.record(self._current_stream(self.device))

    def query(self, event: Any) -> bool:
        """True once the GPU passed ``event`` (``cudaEventQuery``, never waits)."""
        return event.query()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed events."""
        return start.elapsed_time(end)

    def memory(self) -> Memory:
        """The allocator's ``allocated_bytes.all`` of this device, read on the host."""
        s = self._stats(self.device)["allocated_bytes"]["all"]
        if not self.exact_peaks:
            return s["current"], s["peak"], -1, -1
        return s["current"], s["peak"], s["allocated"], s["freed"]

    def reset_peak(self) -> None:
        """Reset this device's peak statistics (only for ``peak_memory="reset"``)."""
        self._cuda.reset_peak_memory_stats(self.device)
