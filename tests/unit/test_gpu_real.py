"""GpuTimer on a real CUDA device: skipped where torch.cuda.is_available() is False.

Each test can fail: a phase queuing a second of GPU work (``torch.cuda._sleep``) must
leave the host within milliseconds (any wait would show as a second); a known kernel is
timed by the markers and by events alone; a phase inside ``torch.cuda.graph`` must not
break the capture; the GPU start of a queued phase is placed after the work before it;
``cudaMallocAsync`` peaks are never flagged exact.
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from markers.gpu import GpuTimer, open_gpu_timer  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1024 * 1024
ROUNDING = 2 * MiB  # the caching allocator rounds large blocks up to 2 MiB


@pytest.fixture
def timer() -> GpuTimer:
    torch.cuda.init()
    t = open_gpu_timer(pool_size=64)
    assert t is not None, "CUDA is initialized, so a timer must open"
    assert t.device_uuid.startswith(("GPU-", "MIG-")) and t.device_name
    return t


def wait(
    timer: GpuTimer, slot: int, timeout_s: float = 60.0, host_start_ns: int = 0
) -> tuple[int, int, int]:
    """The test's own bounded wait for one slot (the training loop never does this)."""
    deadline = time.monotonic() + timeout_s
    while (res := timer.poll(slot, host_start_ns)) is None:
        assert time.monotonic() < deadline, "GPU work did not complete"
        time.sleep(0.0002)
    return res


def settle() -> None:
    gc.collect()
    torch.cuda.synchronize()  # test set-up only, outside any marked phase


@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    """How many ``torch.cuda._sleep`` cycles take one millisecond on this GPU (calibrated
    once, with events and a wait: set-up, outside any marked phase)."""
    torch.cuda.init()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # warm the clocks up
    rates = []
    for _ in range(3):
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        rates.append(50_000_000 / start.elapsed_time(end))
    return statistics.median(rates)


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch):
    """torch.cuda.synchronize() and Event.synchronize() do not go through the sync-debug
    mode: make them fail outright while the test runs; the rest (.item(), .cpu(), ...)
    raises under set_sync_debug_mode("error")."""

    def forbidden(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a synchronizing call")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", forbidden)
    torch.cuda.set_sync_debug_mode("error")
    yield
    torch.cuda.set_sync_debug_mode(0)


def test_a_phase_queuing_a_second_of_gpu_work_leaves_the_host_at_once(
    cycles_per_ms, timer, no_host_sync
):
    second = int(cycles_per_ms * 1000)
    for _ in range(3):  # the pool's events are created by torch at their first record
        slot = timer.begin()
        timer.end(slot)
    t0 = time.perf_counter()
    slot = timer.begin()
    torch.cuda._sleep(second)  # one second of GPU work, queued
    timer.end(slot)
    first_poll = timer.poll(slot)
    host_s = time.perf_counter() - t0
    assert first_poll is None  # the GPU is not there yet, and poll did not wait for it
    assert host_s < 0.05, f"the host spent {host_s:.3f} s in a phase: it waited for the GPU"
    gpu_ns, _, _ = wait(timer, slot)
    assert abs(gpu_ns - 1e9) < 0.1e9, gpu_ns  # and it was timed as the second it took


def test_a_known_kernel_timed_by_the_markers_and_by_events_alone(cycles_per_ms, timer):
    cycles = int(cycles_per_ms * 20)  # 20 ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ref, ours = [], []
    for _ in range(10):  # interleaved, so clock changes hit both alike
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        ref.append(start.elapsed_time(end) * 1e6)
        slot = timer.begin()
        torch.cuda._sleep(cycles)
        timer.end(slot)
        ours.append(wait(timer, slot)[0])
    assert abs(statistics.median(ours) - statistics.median(ref)) <= 0.02 * statistics.median(ref)


def test_the_gpu_start_of_a_queued_phase_comes_after_the_work_before_it(cycles_per_ms, timer):
    settle()
    first_start = time.perf_counter_ns()
    first = timer.begin()
    torch.cuda._sleep(int(cycles_per_ms * 500))  # half a second ...
    timer.end(first)
    second_start = time.perf_counter_ns()
    second = timer.begin()  # ... the host moves on at once
    torch.cuda._sleep(int(cycles_per_ms * 10))
    timer.end(second)
    assert wait(timer, first, host_start_ns=first_start)[2] < 20e6  # the GPU was idle
    lag_ns = wait(timer, second, host_start_ns=second_start)[2]
    assert abs(lag_ns - 0.5e9) < 0.05e9, lag_ns


def test_phases_inside_a_cuda_graph_capture_leave_it_intact(cycles_per_ms, timer):
    x = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as PyTorch asks
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    captured = timer.captured
    with torch.cuda.graph(graph):  # raises if anything broke the capture
        slot = timer.begin()
        y = x * 2
        torch.cuda._sleep(int(cycles_per_ms * 5))
        timer.end(slot)
        assert timer.drain([slot], 0.0) == [(-1, -1, 0)]  # queries nothing while capturing
    assert slot == -1 and timer.captured == captured + 1
    slot = timer.begin()
    graph.replay()  # the replay is ordinary work, timed as such
    timer.end(slot)
    assert 4e6 < wait(timer, slot)[0] < 50e6
    assert torch.equal(y, x * 2)


def test_cuda_malloc_async_peaks_are_never_flagged_exact():
    """In a fresh process: the allocator backend is chosen before CUDA starts."""
    code = textwrap.dedent("""
        import torch
        from markers.gpu import open_gpu_timer
        torch.cuda.init()
        assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
        timer = open_gpu_timer(pool_size=4)
        held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        slot = timer.begin()
        temporary = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        temporary.fill_(1)
        del temporary  # freed again: current is back where it was
        timer.end(slot)
        while (res := timer.poll(slot)) is None:
            pass
        assert res[1] >= (64 + 256) << 20, res  # never under the true peak
        assert timer.inexact_peaks == 1  # and not flagged exact
        print("ok")
    """)
    env = dict(
        os.environ,
        PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_device_holding_the_model_is_timed_without_set_device():
    code = textwrap.dedent("""
        import torch
        from markers.cuda import format_uuid
        from markers.gpu import open_gpu_timer
        model = torch.nn.Linear(256, 256).to("cuda:1")  # no torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 0
        timer = open_gpu_timer(pool_size=4)
        assert timer._backend.device == 1, timer._backend.chosen_by
        props = torch.cuda.get_device_properties
        assert timer.device_uuid == format_uuid(props(1).uuid) != format_uuid(props(0).uuid)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_matmul_time_matches_cuda_events(timer):
    n = 4096
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    c = torch.empty(n, n, device="cuda")

    def work():
        for _ in range(4):
            torch.mm(a, b, out=c)

    for _ in range(5):  # warm up clocks, cuBLAS heuristics, the pool's events
        work()
        slot = timer.begin()
        work()
        timer.end(slot)
        wait(timer, slot)
    settle()
    ref, ours = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(15):  # interleaved, so clock drift hits both alike
        start.record()
        work()
        end.record()
        end.synchronize()  # the reference may wait: it is not the thing under test
        ref.append(start.elapsed_time(end) * 1e6)
        slot = timer.begin()
        work()
        timer.end(slot)
        gpu_ns, _, _ = wait(timer, slot)
        ours.append(gpu_ns)
    assert all(isinstance(v, int) for v in ours)
    ref_med, our_med = statistics.median(ref), statistics.median(ours)
    assert abs(our_med - ref_med) <= 0.05 * ref_med, (our_med, ref_med)
    assert timer.dropped == 0


def test_phase_peak_of_a_known_tensor(timer):
    settle()
    size = 256 * MiB
    # (1) allocate, use and free a tensor: the peak is the base plus the tensor
    base = torch.cuda.memory_allocated()
    slot = timer.begin()
    t = torch.empty(size, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    del t
    timer.end(slot)
    _, peak, _ = wait(timer, slot)
    assert abs(peak - (base + size)) <= ROUNDING, (peak, base, size)

    # (2) a phase that raises the process high-water mark: exact, read from the mark
    settle()
    base = torch.cuda.memory_allocated()
    big = torch.cuda.max_memory_allocated() + size
    inexact = timer.inexact_peaks
    slot = timer.begin()
    t = torch.empty(big, dtype=torch.uint8, device="cuda")
    t.fill_(2)
    del t
    timer.end(slot)
    _, peak, _ = wait(timer, slot)
    assert abs(peak - (base + big)) <= ROUNDING, (peak, base, big)
    assert peak == torch.cuda.max_memory_allocated()
    assert timer.inexact_peaks == inexact

    # (3) a phase that keeps what it allocates: exact, the allocation at its end
    settle()
    base = torch.cuda.memory_allocated()
    slot = timer.begin()
    kept = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    timer.end(slot)
    _, peak, _ = wait(timer, slot)
    assert abs(peak - (base + size)) <= ROUNDING
    del kept


def test_users_own_peak_statistics_survive(timer):
    settle()
    torch.cuda.reset_peak_memory_stats()  # the user's own reset, in the user's code
    base = torch.cuda.memory_allocated()
    user = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")  # the user's big tensor
    expected = base + 512 * MiB
    del user
    for _ in range(5):  # marked phases with smaller allocations
        slot = timer.begin()
        t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        t.fill_(3)
        del t
        timer.end(slot)
        wait(timer, slot)
    assert abs(torch.cuda.max_memory_allocated() - expected) <= ROUNDING
    assert torch.cuda.max_memory_allocated() >= expected


def test_reset_mode_is_exact_and_costs_the_users_peak():
    torch.cuda.init()
    timer = open_gpu_timer(pool_size=4, peak_memory="reset")
    settle()
    user = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del user
    user_peak = torch.cuda.max_memory_allocated()
    base = torch.cuda.memory_allocated()
    slot = timer.begin()
    t = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    del t
    timer.end(slot)
    _, peak, _ = wait(timer, slot)
    assert abs(peak - (base + 16 * MiB)) <= ROUNDING
    assert torch.cuda.max_memory_allocated() < user_peak  # the documented trade-off


def test_forked_dataloader_workers_leave_the_parents_cuda_events_alone():
    """In a fresh process: a marked loop on the GPU, then epochs of a DataLoader with forked
    workers. A worker freeing the parent's events would print CUDA initialization
    errors (or be killed) at every epoch's worker start."""
    code = textwrap.dedent("""
        import os, tempfile, torch
        from markers.run import Run
        from markers.transport import Sender
        endpoint = f"ipc://{tempfile.mkdtemp()}/nobody.sock"  # records queue, unread
        run = Run(Sender(endpoint, os.urandom(16), 0),
                  {"type": "hello", "accumulation_steps": 1}, monitored=True)
        x = torch.randn(64, 64, device="cuda")
        loader = torch.utils.data.DataLoader(list(range(64)), batch_size=8, num_workers=2,
                                             multiprocessing_context="fork")
        for _ in range(3):
            for _batch in run.train_batches(loader):
                with run.phase("forward"):
                    y = x @ x
        assert run._buffer.gpu is not None, "GPU timing never started"
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr
    assert "initialization error" not in proc.stderr, proc.stderr


def test_the_gpu_start_lag_holds_while_the_loop_stays_ahead(cycles_per_ms, timer):
    """The GPU idles once (the anchor is exact), then the loop keeps ~50 ms of work queued
    for 600 phases: the lag must stay ~50 ms, not fall poll by poll."""
    settle()
    pending, lags = [], []
    torch.cuda._sleep(int(cycles_per_ms * 50))  # 50 ms queued ahead of every phase
    while len(lags) < 600:
        start_ns = time.perf_counter_ns()
        slot = timer.begin()
        torch.cuda._sleep(int(cycles_per_ms * 1))
        timer.end(slot)
        pending.append((slot, start_ns))
        while pending and (res := timer.poll(*pending[0])) is not None:
            pending.pop(0)
            lags.append(res[2])
        time.sleep(0.001)  # the host's step, ~1 ms: the queue stays ~50 ms deep
    late = statistics.median(lags[-100:])
    assert 30e6 < late < 70e6, late
