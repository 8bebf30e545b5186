"""The CUDA glue (markers.cuda) and GpuTimer over ``FakeCuda``, a stand-in for torch.cuda
with several devices and streams, a GPU that runs behind the host, graph capture and
both allocator backends: the device chosen, where events go, lag, capture, MIG names."""

from __future__ import annotations

import time
import types

import pytest

from markers.cuda import (
    TorchCudaBackend,
    check_device_spec,
    choose_device,
    device_index,
    format_uuid,
)
from markers.gpu import GpuTimer, open_gpu_timer
from tests.support.fake_cuda import FakeCuda, FakeCudaEvent, cuda_device, fake_torch

MiB = 1024 * 1024


def module_on(index: int | None) -> types.SimpleNamespace:
    """Something shaped like an nn.Module whose parameters live on cuda:index (or CPU)."""
    import torch

    device = torch.device("cpu") if index is None else cuda_device(index)
    parameter = types.SimpleNamespace(device=device)
    return types.SimpleNamespace(parameters=lambda: iter([parameter]), type=lambda *_: None)


def wait(timer: GpuTimer, slot: int, host_start_ns: int = 0) -> tuple[int, int, int]:
    """The test's own bounded wait (the training loop never waits)."""
    deadline = time.monotonic() + 10
    while (res := timer.poll(slot, host_start_ns)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return res


# ---- which device ----------------------------------------------------------------


def test_device_given_as_index_string_device_tensor_or_module() -> None:
    cuda = FakeCuda(["A", "B", "C"])
    for spec in (
        2,
        "cuda:2",
        cuda_device(2),
        types.SimpleNamespace(device=cuda_device(2)),
        module_on(2),
    ):
        assert choose_device(cuda, spec) == (2, "argument"), spec
    for bad in (-1, "gpu0", 1.5, True):
        with pytest.raises(ValueError):
            check_device_spec(bad)
    assert device_index(module_on(None)) is None  # still on the CPU: decided later


def test_ddp_without_set_device_times_the_device_holding_the_model(monkeypatch) -> None:
    # model.to("cuda:2") without torch.cuda.set_device(2): the current device stays 0
    monkeypatch.setenv("LOCAL_RANK", "1")  # a wrong hint loses against where memory is
    cuda = FakeCuda(["A", "B", "C"], current=0)
    cuda.alloc(1 * MiB, device=0)  # a stray tensor on device 0
    cuda.alloc(400 * MiB, device=2)  # the model
    assert choose_device(cuda) == (2, "allocations")
    backend = TorchCudaBackend(fake_torch(cuda), *choose_device(cuda))
    assert backend.device_uuid == format_uuid(types.SimpleNamespace(bytes=cuda.devices[2].uuid))
    timer = GpuTimer(backend, pool_size=4)
    slot = timer.begin()
    cuda.launch(0.001)  # the script's kernels go where its tensors are: cuda:2
    timer.end(slot)
    assert {stream.device for _, stream in cuda.records} == {2}  # never on device 0
    assert wait(timer, slot)[1] == 401 * MiB - 1 * MiB  # device 2's allocator, not 0's


def test_local_rank_then_current_device_when_nothing_is_allocated(monkeypatch) -> None:
    cuda = FakeCuda(["A", "B"], current=0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert choose_device(cuda) == (1, "LOCAL_RANK")
    monkeypatch.setenv("LOCAL_RANK", "5")  # one GPU visible per rank: not an index here
    assert choose_device(cuda) == (0, "current device")


def test_async_allocator_is_not_probed_where_it_has_no_context() -> None:
    cuda = FakeCuda(["A", "B"], allocator="cudaMallocAsync", current=1)
    assert choose_device(cuda) == (1, "current device")
    assert not cuda.devices[0].context  # probing created no context on the idle GPU


def test_mig_instance_uuid_is_spelled_as_nvml_does() -> None:
    cuda = FakeCuda(["NVIDIA A100-SXM4-40GB MIG 1g.5gb"])
    backend = TorchCudaBackend(fake_torch(cuda), 0)
    assert backend.device_uuid.startswith("MIG-")
    assert (
        format_uuid("GPU-8F1C0000-1111-2222-3333-444444444444", mig=True)
        == "MIG-8f1c0000-1111-2222-3333-444444444444"
    )


# ---- what the timer does on a GPU that runs behind the host ---------------------------


def test_a_second_of_queued_gpu_work_leaves_the_host_at_once_and_is_timed() -> None:
    cuda = FakeCuda(["A"])
    timer = GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=8)
    t0 = time.perf_counter()
    slot = timer.begin()
    cuda._sleep(1_000_000_000)  # one second on the fake 1 GHz GPU
    timer.end(slot)
    assert timer.poll(slot) is None  # the GPU is not there yet; poll did not wait
    assert time.perf_counter() - t0 < 0.1
    gpu_ns, _, _ = wait(timer, slot)
    assert abs(gpu_ns - 1e9) < 1e6
    assert cuda.syncs == []


def test_gpu_start_lag_is_estimated_on_the_host_clock() -> None:
    cuda = FakeCuda(["A"])
    timer = GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=8)
    first_start = time.perf_counter_ns()
    first = timer.begin()
    cuda.launch(0.4)
    timer.end(first)
    second_start = time.perf_counter_ns()  # the host moves on at once ...
    second = timer.begin()
    cuda.launch(0.1)
    timer.end(second)
    assert wait(timer, first, first_start)[2] < 20e6  # the GPU was idle: no lag
    lag_ns = wait(timer, second, second_start)[2]
    assert abs(lag_ns - 0.4e9) < 50e6  # ... the GPU starts it once the first is done


def test_the_anchor_estimate_follows_a_gpu_clock_running_fast() -> None:
    """A phase whose bound is below the estimate lowers it by at most the measured drift
    (none measured yet: not at all)."""
    cuda = FakeCuda(["A"])
    timer = GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=4)
    before = timer._anchor_ns
    slot = timer.begin()
    timer.end(slot)
    res = wait(timer, slot, time.perf_counter_ns() - 10_000_000)  # 10 ms "too early"
    assert res[2] >= 0 and before - 1_000_000 < timer._anchor_ns <= before + 50_000_000


def test_capture_through_torch_cuda_graph_is_never_invalidated() -> None:
    cuda = FakeCuda(["A"])
    timer = GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=8)
    with cuda.graph() as graph:
        slot = timer.begin()
        cuda.launch(0.01)
        timer.end(slot)
        assert timer.drain([slot], 0.01) == [(-1, -1, 0)]
    assert not cuda.capture_invalidated and graph.work_ns == 10_000_000
    assert timer.captured == 1
    replay = timer.begin()  # replaying the graph is timed as any work
    graph.replay()
    timer.end(replay)
    assert abs(wait(timer, replay)[0] - 10e6) < 1e6


def test_open_gpu_timer_uses_the_device_argument(monkeypatch) -> None:
    import sys

    cuda = FakeCuda(["A", "B"], allocator="cudaMallocAsync")
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    timer = open_gpu_timer(pool_size=2, device="cuda:1")
    assert timer is not None and timer._backend.device == 1
    assert not timer._backend.exact_peaks  # cudaMallocAsync


def test_the_gpu_start_lag_holds_in_a_loop_that_stays_ahead_of_its_gpu() -> None:
    """The GPU is idle when timing starts, then stays 50 ms behind the host for good (a loop
    that never syncs): every start bound is below the estimate, which may fall only by
    the clock-drift allowance of the time since the last exact bound, never compounding
    with every poll."""
    cuda = FakeCuda(["A"])
    timer = GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=64)
    cuda.queue_delay_s = 0.05
    pending: list[tuple[int, int, FakeCudaEvent]] = []
    errors_ms: list[float] = []
    while len(errors_ms) < 1000:
        host_start_ns = time.perf_counter_ns()
        slot = timer.begin()
        cuda.launch(0.0002)
        timer.end(slot)
        pending.append((slot, host_start_ns, timer._starts[slot]))
        while pending and (res := timer.poll(pending[0][0], pending[0][1])) is not None:
            _, start_ns, event = pending.pop(0)
            assert event.at_ns is not None
            true_lag_ns = event.at_ns - start_ns  # when the fake GPU really began it
            errors_ms.append((res[2] - true_lag_ns) / 1e6)
        time.sleep(0.001)  # the host's own work per step: time passes between polls
    late = errors_ms[-100:]
    assert max(abs(e) for e in late) < 3, (min(late), max(late))


def test_a_phase_builds_the_allocator_dict_twice_through_the_c_function_alone() -> None:
    """ "bound" peaks read the allocator at begin and end: one C call each, without the
    public wrapper's checks (no torch call returns fewer counters; see gpu-timing.md)."""
    cuda = FakeCuda(["A"])
    timer = GpuTimer(TorchCudaBackend(fake_torch(cuda), 0), pool_size=4)
    cuda.public_stats_calls = cuda.c_stats_calls = 0
    slot = timer.begin()
    cuda.alloc(MiB)
    timer.end(slot)
    assert (cuda.c_stats_calls, cuda.public_stats_calls) == (2, 0)
    assert wait(timer, slot)[1] == MiB
