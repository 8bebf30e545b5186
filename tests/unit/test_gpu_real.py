"""GpuTimer on a real CUDA device: skipped where torch.cuda.is_available() is False."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque

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
    assert t.device_uuid.startswith("GPU-") and t.device_name
    return t


def wait(timer: GpuTimer, slot: int, timeout_s: float = 60.0) -> tuple[int, int]:
    """The test's own bounded wait for one slot (the training loop never does this)."""
    deadline = time.monotonic() + timeout_s
    while (res := timer.poll(slot)) is None:
        assert time.monotonic() < deadline, "GPU work did not complete"
        time.sleep(0.0002)
    return res


def settle() -> None:
    gc.collect()
    torch.cuda.synchronize()  # test set-up only, outside any marked phase


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
        gpu_ns, _ = wait(timer, slot)
        ours.append(gpu_ns)
    assert all(isinstance(v, int) for v in ours)
    ref_med, our_med = statistics.median(ref), statistics.median(ours)
    assert abs(our_med - ref_med) <= 0.05 * ref_med, (our_med, ref_med)
    assert timer.dropped == 0


def test_marked_training_step_never_synchronizes(timer):
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 256, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def step(marked: bool, pending: deque, results: list) -> None:
        slot = timer.begin() if marked else -1
        loss = torch.nn.functional.cross_entropy(model(x), y)
        timer.end(slot)
        pending.append(slot)
        slot = timer.begin() if marked else -1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        timer.end(slot)
        pending.append(slot)
        slot = timer.begin() if marked else -1
        opt.step()
        timer.end(slot)
        pending.append(slot)
        while pending and (res := timer.poll(pending[0])) is not None:  # the Run's flush
            results.append(res)
            pending.popleft()

    pending: deque = deque()
    results: list = []
    step(True, pending, results)  # warm up: cuBLAS handles, optimizer state, events
    settle()
    pending.clear()
    results.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            step(True, pending, results)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rest = timer.drain(list(pending), timeout_s=30.0)
    results.extend(rest)
    assert len(results) == 30
    assert all(r is not None and r[0] > 0 and r[1] > 0 for r in results)
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
    _, peak = wait(timer, slot)
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
    _, peak = wait(timer, slot)
    assert abs(peak - (base + big)) <= ROUNDING, (peak, base, big)
    assert peak == torch.cuda.max_memory_allocated()
    assert timer.inexact_peaks == inexact

    # (3) a phase that keeps what it allocates: exact, the allocation at its end
    settle()
    base = torch.cuda.memory_allocated()
    slot = timer.begin()
    kept = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    timer.end(slot)
    _, peak = wait(timer, slot)
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
    _, peak = wait(timer, slot)
    assert abs(peak - (base + 16 * MiB)) <= ROUNDING
    assert torch.cuda.max_memory_allocated() < user_peak  # the documented trade-off
