"""Stand-ins for CUDA on a machine without a GPU, behaving as the real libraries do.

* ``FakeBackend``: a ``markers.gpu.EventBackend`` whose single in-order stream the test
  steps by hand (``done``), for the GpuTimer's bookkeeping.
* ``FakeCuda``: a stand-in for ``torch.cuda`` for ``markers.cuda.TorchCudaBackend`` and
  the whole markers path. Several devices, each with its own streams and allocator
  (``native`` or ``cudaMallocAsync``, whose cumulative counters stay 0 as in PyTorch);
  kernels (``_sleep``) run on a GPU that falls behind the host in real time, so events
  complete later than they were recorded; CUDA graph capture in which events become
  nodes and an event query invalidates the capture; synchronizing calls that are counted
  in ``syncs`` (as in torch, ``synchronize()`` and ``Event.synchronize()`` do not go
  through ``set_sync_debug_mode``, so a test must count them); MIG instance names.
  ``queue_delay_s``: from the moment it is set, the GPU starts each piece of work that
  long after the host queued it at the earliest (a loop that stays ahead of its GPU).
  An event recorded once has a destructor that, as torch's ``cudaEventDestroy`` does,
  touches the device: run in a forked child (which must not touch CUDA) it writes a
  line to stderr and is counted in ``FakeCuda.destroyed_in_child`` of the child.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import uuid as _uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch  # only for torch.device, which needs no CUDA

CURRENT_STREAM_COST_S = 2e-6  # torch.cuda.current_stream(), per call (see FakeCuda)

# --------------------------------------------------------------------------------------
# FakeBackend: the EventBackend protocol, stepped by the test


def _float32(ms: float) -> float:
    """``ms`` as CUDA's ``cudaEventElapsedTime`` gives it: float32 milliseconds."""
    return float(struct.unpack("f", struct.pack("f", ms))[0])


class FakeEvent:
    def __init__(self) -> None:
        self.seq = None  # position on the fake stream of the latest record
        self.t_ms = None


class FakeBackend:
    """A single in-order stream whose progress the test controls."""

    device_uuid = "GPU-00000000-1111-2222-3333-444444444444"
    device_name = "Fake GPU"

    def __init__(self, exact_peaks: bool = True) -> None:
        self.exact_peaks = exact_peaks
        self.recorded = 0  # events recorded so far
        self.done = 0  # the GPU has passed the first `done` events
        self.clock_ms = 0.0  # timestamp the next recorded event gets
        # current, peak, allocated (cumulative), freed (cumulative); cudaMallocAsync
        # keeps no cumulative counters: the backend reads them as -1
        self.mem = [0, 0, 0, 0]
        self.new_events = 0
        self.resets = 0
        self.fail_record = False
        self.queries = 0
        self.capture = False  # a CUDA graph capture is under way
        self.later: tuple[int, int] | None = None  # (after this many queries, set done)
        self.float32 = False  # elapsed times in float32, as CUDA's (a clock driven for hours)

    # EventBackend
    def new_event(self) -> FakeEvent:
        self.new_events += 1
        return FakeEvent()

    def record(self, event: FakeEvent) -> None:
        if self.fail_record:
            raise RuntimeError("device gone")
        assert not self.capture, "an event recorded during a graph capture"
        event.seq = self.recorded
        event.t_ms = self.clock_ms
        self.recorded += 1

    def query(self, event: FakeEvent) -> bool:
        assert not self.capture, "an event queried during a graph capture"
        self.queries += 1
        if self.later is not None and self.queries >= self.later[0]:
            self.done = max(self.done, self.later[1])
        return event.seq is None or event.seq < self.done

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        assert self.query(start) and self.query(end), "elapsed_ms on an incomplete event"
        assert start.t_ms is not None and end.t_ms is not None
        return _float32(end.t_ms - start.t_ms) if self.float32 else end.t_ms - start.t_ms

    def memory(self) -> tuple[int, int, int, int]:
        if not self.exact_peaks:
            return self.mem[0], self.mem[1], -1, -1
        return tuple(self.mem)

    def reset_peak(self) -> None:
        self.resets += 1
        self.mem[1] = self.mem[0]

    def capturing(self) -> bool:
        return self.capture

    # helpers for the tests: the allocator, as the phase's launches move it
    def alloc(self, n: int) -> None:
        self.mem[0] += n
        self.mem[2] += n
        self.mem[1] = max(self.mem[1], self.mem[0])

    def free(self, n: int) -> None:
        self.mem[0] -= n
        self.mem[3] += n

    def finish_all(self) -> None:
        self.done = self.recorded


# --------------------------------------------------------------------------------------
# FakeCuda: torch.cuda with a GPU that runs behind the host


@dataclass
class Stream:
    device: int
    cuda: Any = field(default=None, repr=False, compare=False)  # its FakeCuda (queue delay)
    busy_until_ns: int = 0  # host time at which the GPU will have run all queued work
    capturing: bool = False
    captured_ns: int = 0  # work captured into the graph being built

    def enqueue(self, duration_ns: int) -> int:
        """Queue work; the host time at which the GPU reaches the end of it."""
        if self.capturing:
            self.captured_ns += duration_ns
            return 0
        delay_ns = int(self.cuda.queue_delay_s * 1e9) if self.cuda is not None else 0
        self.busy_until_ns = (
            max(time.perf_counter_ns() + delay_ns, self.busy_until_ns) + duration_ns
        )
        return self.busy_until_ns


@dataclass
class Device:
    index: int
    name: str
    uuid: bytes
    allocator: str = "native"
    stats: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("current", "peak", "allocated", "freed"), 0)
    )
    context: bool = False  # a CUDA context exists on it
    streams: list[Stream] = field(default_factory=list)
    current: Stream | None = None


class Recorded(NamedTuple):
    """One ``Event.record`` call as FakeCuda logs it."""

    in_graph: bool  # recorded during a graph capture: a node, not a timing event


class FakeCudaEvent:
    """torch.cuda.Event: timestamped when the GPU reaches it on its stream."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
        self._cuda = cuda
        self.timing = enable_timing
        self.at_ns: int | None = None  # host time at which the GPU reaches it
        self.device: int | None = None
        self.in_graph = False  # recorded during a capture: a graph node, no timestamp
        self._pid = os.getpid()  # the process whose CUDA context holds the event

    def __del__(self) -> None:
        # torch's CUDAEvent destructor sets the device and calls cudaEventDestroy: in a
        # forked child CUDA is unusable and that call fails ("initialization error").
        if self.device is not None and os.getpid() != self._pid:
            self._cuda.destroyed_in_child += 1
            os.write(
                2, b"CUDA warning: initialization error (an event destroyed in a forked child)\n"
            )

    def record(self, stream: Stream | None = None) -> None:
        cuda = self._cuda
        stream = stream or cuda.current_stream()
        if self.device is not None and self.device != stream.device:
            raise RuntimeError("Event device does not match recording stream's device")
        self.device = stream.device
        cuda.devices[stream.device].context = True
        cuda.records.append((Recorded(stream.capturing), stream))
        if stream.capturing:
            self.in_graph, self.at_ns = True, None
            return
        self.in_graph = False
        self.at_ns = stream.enqueue(0)

    def query(self) -> bool:
        cuda = self._cuda
        cuda.queries += 1
        if any(s.capturing for d in cuda.devices for s in d.streams):
            cuda.capture_invalidated = True  # global capture mode: an unsafe call
            raise RuntimeError("operation not permitted when stream is capturing")
        return (self.at_ns is None and not self.in_graph) or (
            self.at_ns is not None and time.perf_counter_ns() >= self.at_ns
        )

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        if not (self.timing and end.timing) or self.in_graph or end.in_graph:
            raise RuntimeError(
                "Both events must be recorded with timing before calling elapsed_time()"
            )
        if self.at_ns is None or end.at_ns is None or not (self.query() and end.query()):
            raise RuntimeError("device not ready")
        # CUDA computes it in float32 milliseconds, on the GPU's own clock
        gpu_ns = (end.at_ns - self.at_ns) * (1 + self._cuda.drift_ppm * 1e-6)
        return _float32(gpu_ns / 1e6)

    def synchronize(self) -> None:
        self._cuda._sync("Event.synchronize")
        if self.at_ns is not None:
            time.sleep(max(0.0, (self.at_ns - time.perf_counter_ns()) / 1e9))


class FakeCuda:
    """Use as ``torch.cuda``: ``types.ModuleType("torch")`` with ``.cuda = FakeCuda(...)``
    in ``sys.modules``, or hand it to ``TorchCudaBackend`` through such a namespace."""

    def __init__(self, names: list[str], allocator: str = "native", current: int = 0) -> None:
        self.devices = [
            Device(i, name, _uuid.UUID(int=0xC0DA0000 + i).bytes, allocator)
            for i, name in enumerate(names)
        ]
        for device in self.devices:
            device.current = Stream(device.index, self)
            device.streams.append(device.current)
        self._current = current
        self.initialized = True
        self.sync_mode = 0
        self.syncs: list[str] = []  # every synchronizing call, by name
        # every record: what it was, and on which stream (the event itself is not held, so
        # its destructor runs when the code under test lets it go)
        self.records: list[tuple[Recorded, Stream]] = []
        self.queries = 0
        self.capture_invalidated = False
        self.queue_delay_s = 0.0  # see the module docstring
        self.destroyed_in_child = 0  # events whose destructor ran in a forked child
        self.public_stats_calls = 0  # memory_stats_as_nested_dict calls
        self.c_stats_calls = 0  # allocator dicts built (the C function, however reached)
        # The GPU's timer runs this many parts per million fast (negative: slow) against the
        # host's perf_counter, as a real one drifts: event times are on the GPU's clock.
        self.drift_ppm = 0.0
        # What torch.cuda.current_stream() costs the host per call (s): it builds a new
        # Stream object from the C stream each time, and Event.record() without a stream
        # calls it on every record. About 2 µs on a recent CPU (the GPU pass measures the
        # markers' host cost per phase with it included).
        self.current_stream_cost_s = CURRENT_STREAM_COST_S

    # -- what TorchCudaBackend and choose_device call ------------------------------------

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.devices)

    def current_device(self) -> int:
        return self._current

    def set_device(self, index: int) -> None:
        self._current = index

    def get_device_properties(self, index: int) -> SimpleNamespace:
        device = self.devices[index]
        return SimpleNamespace(name=device.name, uuid=SimpleNamespace(bytes=device.uuid))

    def get_allocator_backend(self) -> str:
        return self.devices[self._current].allocator

    def Event(self, enable_timing: bool = False) -> FakeCudaEvent:
        return FakeCudaEvent(self, enable_timing)

    def current_stream(self, device: int | None = None) -> Stream:
        index = self._current if device is None else device
        end = time.perf_counter() + self.current_stream_cost_s
        while time.perf_counter() < end:  # the host time torch spends building the object
            pass
        return self.devices[index].current

    def is_current_stream_capturing(self) -> bool:
        return self.current_stream().capturing

    def memory_stats_as_nested_dict(self, device: int | None = None) -> dict[str, Any]:
        """The public wrapper: torch checks initialisation and the device index, then
        calls the C function (``_cuda_memoryStats``, ``fake_torch(cuda)._C``)."""
        self.public_stats_calls += 1
        if not self.is_initialized():
            return {}
        return self._memory_stats(self._current if device is None else int(device))

    def _memory_stats(self, device: int) -> dict[str, Any]:
        """torch._C._cuda_memoryStats: the allocator's whole nested dict, built anew."""
        self.c_stats_calls += 1
        dev = self.devices[device]
        if dev.allocator != "native" and not dev.context:
            # cudaMallocAsync on a device it has not initialised: every counter 0
            return allocator_stats(dict.fromkeys(dev.stats, 0))
        return allocator_stats(dev.stats)

    def memory_stats(self, device: int | None = None) -> dict[str, Any]:
        """torch.cuda.memory_stats: the nested dict flattened, keys sorted, as torch does."""
        flat: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    walk(f"{prefix}.{key}" if prefix else key, inner)
            else:
                flat[prefix] = value

        walk("", self.memory_stats_as_nested_dict(device))
        return dict(sorted(flat.items()))

    def max_memory_allocated(self, device: int | None = None) -> int:
        return self.memory_stats(device).get("allocated_bytes.all.peak", 0)

    def reset_peak_memory_stats(self, device: int | None = None) -> None:
        stats = self.devices[self._current if device is None else device].stats
        stats["peak"] = stats["current"]

    def synchronize(self, device: int | None = None) -> None:
        self._sync("torch.cuda.synchronize")
        for dev in self.devices:
            for stream in dev.streams:
                time.sleep(max(0.0, (stream.busy_until_ns - time.perf_counter_ns()) / 1e9))

    def set_sync_debug_mode(self, mode: int | str) -> None:
        self.sync_mode = mode

    # -- what a training script does -------------------------------------------------

    def _sleep(self, cycles: int) -> None:
        """Queue a kernel of ``cycles`` ns on the current stream (the fake runs at 1 GHz)."""
        self.current_stream().enqueue(int(cycles))

    def launch(self, seconds: float, device: int | None = None) -> None:
        """Queue ``seconds`` of GPU work on the current stream of ``device``."""
        self.current_stream(device).enqueue(int(seconds * 1e9))

    def alloc(self, nbytes: int, device: int | None = None) -> None:
        dev = self.devices[self._current if device is None else device]
        dev.context = True
        stats = dev.stats
        stats["current"] += nbytes
        stats["peak"] = max(stats["peak"], stats["current"])
        if dev.allocator == "native":  # cudaMallocAsync keeps no cumulative counters
            stats["allocated"] += nbytes

    def free(self, nbytes: int, device: int | None = None) -> None:
        dev = self.devices[self._current if device is None else device]
        dev.stats["current"] -= nbytes
        if dev.allocator == "native":
            dev.stats["freed"] += nbytes

    def Stream(self, device: int | None = None) -> Stream:
        stream = Stream(self._current if device is None else device, self)
        self.devices[stream.device].streams.append(stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        dev = self.devices[stream.device]
        previous, dev.current = dev.current, stream
        try:
            yield
        finally:
            dev.current = previous

    @contextlib.contextmanager
    def graph(self) -> Iterator[SimpleNamespace]:
        """torch.cuda.graph(g): capture on a side stream; a query inside invalidates it."""
        side = self.Stream()
        side.capturing = True
        self.capture_invalidated = False
        graph = SimpleNamespace(work_ns=0, replay=None)
        with self.stream(side):
            yield graph
        side.capturing = False
        if self.capture_invalidated:
            raise RuntimeError(
                "CUDA error: operation failed due to a previous error "
                "during capture (cudaErrorStreamCaptureInvalidated)"
            )
        work = side.captured_ns
        graph.work_ns = work
        graph.replay = lambda: self.current_stream().enqueue(work)

    def busy_until_ns(self, device: int | None = None) -> int:
        return self.current_stream(device).busy_until_ns

    def _sync(self, what: str) -> None:
        self.syncs.append(what)  # counted, never raised: torch's sync-debug mode skips these


_STAT_ARRAYS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
_POOLS = ("all", "small_pool", "large_pool")
_COUNTERS = ("current", "peak", "allocated", "freed")


def allocator_stats(allocated_all: dict[str, int]) -> dict[str, Any]:
    """The dict ``torch._C._cuda_memoryStats`` builds on every call, in its shape: nine stat
    arrays of three pools of four counters, two more stats and six scalars (39 dicts).
    ``allocated_all`` gives ``allocated_bytes.all``; the rest is 0. Built anew each call,
    as torch does, so the host cost of a read on the fake has the right order."""
    stats: dict[str, Any] = {
        name: {pool: dict.fromkeys(_COUNTERS, 0) for pool in _POOLS} for name in _STAT_ARRAYS
    }
    stats["allocated_bytes"]["all"] = dict(allocated_all)
    for name in ("oversize_allocations", "oversize_segments"):
        stats[name] = dict.fromkeys(_COUNTERS, 0)
    for name in (
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ):
        stats[name] = 0
    return stats


def fake_torch(cuda: FakeCuda) -> Any:
    """A module to put in ``sys.modules["torch"]``: ``cuda``, a version and the one C
    function the markers call, nothing else."""
    import types

    module = types.ModuleType("torch")
    module.cuda = cuda  # type: ignore[attr-defined]
    module.__version__ = "fake"  # type: ignore[attr-defined]
    module._C = SimpleNamespace(_cuda_memoryStats=cuda._memory_stats)  # type: ignore[attr-defined]
    return module


def cuda_device(index: int) -> torch.device:
    """A real ``torch.device("cuda", index)`` (constructible without CUDA)."""
    return torch.device("cuda", index)
