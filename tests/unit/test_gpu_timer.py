"""GpuTimer through a fake EventBackend: runs without a GPU.

The fake stream numbers every recorded event; the test decides how far the "GPU" has got
(``done``), what each event's timestamp is, and what the allocator reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from markers.cuda import format_uuid
from markers.gpu import NOT_MEASURED, GpuTimer, open_gpu_timer, phase_peak
from tests.support.fake_cuda import FakeBackend

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def timed_phase(timer: GpuTimer, fake: FakeBackend, gpu_ms: float) -> int:
    slot = timer.begin()
    fake.clock_ms += gpu_ms
    timer.end(slot)
    return slot


def test_pending_resolve_in_order_and_poll_never_blocks():
    fake = FakeBackend()
    timer = open_gpu_timer(pool_size=8, backend=fake)
    assert timer is not None
    assert (timer.device_uuid, timer.device_name) == (fake.device_uuid, fake.device_name)
    slots = [timed_phase(timer, fake, ms) for ms in (1.5, 2.25, 0.000_5)]
    assert len(set(slots)) == 3
    # nothing has run on the "GPU" yet: every poll answers None at once
    t0 = time.perf_counter()
    for _ in range(1000):
        assert all(timer.poll(s) is None for s in slots)
    assert time.perf_counter() - t0 < 2.0  # 3000 polls; a wait anywhere would show
    # the GPU passes the anchor and the first phase's events: only the first resolves
    fake.done = 3
    assert timer.poll(slots[0]) == (1_500_000, 0, 0)
    assert timer.poll(slots[1]) is None
    assert timer.poll(slots[2]) is None
    # the start event of phase 2 done, its end not yet: still pending
    fake.done = 4
    assert timer.poll(slots[1]) is None
    fake.finish_all()
    assert timer.poll(slots[1]) == (2_250_000, 0, 0)
    assert timer.poll(slots[2]) == (500, 0, 0)  # 0.0005 ms = 500 ns, an integer
    assert timer.in_flight == 0 and timer.dropped == 0


def test_begun_but_not_ended_is_pending():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=2)
    slot = timer.begin()
    fake.finish_all()
    assert timer.poll(slot) is None
    timer.end(slot)
    assert timer.poll(slot) is None  # the end event is recorded but not passed yet
    fake.finish_all()
    assert timer.poll(slot) is not None


def test_pool_dry_drops_counts_and_never_blocks():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=3)
    slots = [timed_phase(timer, fake, 1.0) for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    t0 = time.perf_counter()
    extra = [timer.begin() for _ in range(100)]
    assert time.perf_counter() - t0 < 1.0
    assert extra == [-1] * 100
    assert timer.dropped == 100
    for s in extra:
        timer.end(s)  # no-op
        assert timer.poll(s) == NOT_MEASURED  # resolved at once, so a FIFO never stalls
    assert fake.recorded == 7  # the anchor and 3 phases; the dropped ones recorded nothing
    assert fake.new_events == 7  # the pool and the anchor were made once, up front


def test_released_slots_are_reused_without_new_events():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=2)
    seen = set()
    for _ in range(50):
        slot = timed_phase(timer, fake, 0.25)
        seen.add(slot)
        fake.finish_all()
        assert timer.poll(slot) == (250_000, 0, 0)
    assert seen <= {0, 1}
    assert fake.new_events == 5  # two pairs and the anchor
    assert timer.dropped == 0 and timer.in_flight == 0


def test_reused_slot_reports_the_new_measurement():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=1)
    s = timed_phase(timer, fake, 1.0)
    fake.finish_all()
    assert timer.poll(s) == (1_000_000, 0, 0)
    s2 = timed_phase(timer, fake, 3.0)
    assert s2 == s
    assert timer.poll(s2) is None  # the re-recorded events are pending again
    fake.finish_all()
    assert timer.poll(s2) == (3_000_000, 0, 0)


def test_drain_resolves_within_timeout_and_drops_the_rest():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=8)
    slots = [timed_phase(timer, fake, 1.0) for _ in range(4)]
    unended = timer.begin()  # a phase interrupted by an exception: never ended
    # the GPU finishes phases 0 and 1 only after drain has found them pending a few times
    fake.later = (fake.queries + 20, 5)
    t0 = time.monotonic()
    out = timer.drain([*slots, unended, -1], timeout_s=1.0)
    took = time.monotonic() - t0
    assert fake.queries > 20
    assert out[:2] == [(1_000_000, 0, 0), (1_000_000, 0, 0)]
    assert out[2:5] == [None, None, None]  # never completed / never ended: given up
    assert out[5] == NOT_MEASURED
    assert 0.9 <= took < 10.0  # waited for the deadline, bounded
    assert timer.dropped == 3
    assert timer.in_flight == 0  # everything released
    assert sorted(timer._free) == list(range(8))


def test_drain_returns_early_when_all_complete():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=4)
    slots = [timed_phase(timer, fake, 2.0) for _ in range(3)]
    fake.finish_all()
    t0 = time.monotonic()
    assert timer.drain(slots, timeout_s=30.0) == [(2_000_000, 0, 0)] * 3
    assert time.monotonic() - t0 < 5.0
    assert timer.dropped == 0


def test_drain_with_zero_timeout_does_not_wait():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=4)
    slots = [timed_phase(timer, fake, 2.0) for _ in range(2)]
    t0 = time.monotonic()
    assert timer.drain(slots, timeout_s=0.0) == [None, None]
    assert time.monotonic() - t0 < 1.0
    assert timer.dropped == 2 and timer.in_flight == 0


def test_device_failure_is_counted_not_raised():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=2)
    fake.fail_record = True
    assert timer.begin() == -1
    assert timer.dropped == 1 and timer.in_flight == 0
    fake.fail_record = False
    slot = timer.begin()
    fake.fail_record = True
    timer.end(slot)  # fails while recording the end event
    assert timer.dropped == 2
    assert timer.poll(slot) == NOT_MEASURED  # resolved, not measured; slot freed
    assert timer.in_flight == 0


# ---- peak memory -------------------------------------------------------------------


def test_phase_peak_raising_the_high_water_mark_is_exact():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=4)
    fake.alloc(100 * MiB)  # the user's model, before any phase
    slot = timer.begin()
    fake.alloc(300 * MiB)  # activations ...
    fake.alloc(50 * MiB)  # ... and a temporary
    fake.free(50 * MiB)
    timer.end(slot)
    fake.finish_all()
    _, peak, _ = timer.poll(slot)
    assert peak == 450 * MiB  # the new high-water mark, exactly
    assert timer.inexact_peaks == 0
    assert fake.resets == 0  # the user's statistics were left alone


def test_phase_peak_below_the_mark_is_a_documented_upper_bound():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=4)
    fake.alloc(1000 * MiB)
    fake.free(900 * MiB)  # earlier work left the process high-water mark at 1000 MiB
    assert fake.mem[:2] == [100 * MiB, 1000 * MiB]
    slot = timer.begin()
    fake.alloc(200 * MiB)
    fake.free(200 * MiB)
    fake.alloc(30 * MiB)
    timer.end(slot)
    fake.finish_all()
    _, peak, _ = timer.poll(slot)
    # true peak 300 MiB; the readings bound it in [130, min(1000, 100 + 230)] MiB
    assert peak == 330 * MiB
    assert timer.inexact_peaks == 1
    assert fake.mem[1] == 1000 * MiB and fake.resets == 0


def test_phase_peak_below_the_mark_capped_by_the_mark():
    # allocated a lot in total, but never above the old mark: the mark bounds it
    before = (100, 1000, 5000, 4900)
    after = (120, 1000, 9000, 8880)
    assert phase_peak(before, after) == (1000, False)


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ((100, 1000, 0, 0), (400, 1000, 300, 0), (400, True)),  # only allocations
        ((500, 1000, 0, 0), (200, 1000, 0, 300), (500, True)),  # only frees
        ((500, 1000, 7, 7), (500, 1000, 7, 7), (500, True)),  # nothing happened
        ((100, 1000, 0, 0), (100, 1200, 1100, 1100), (1200, True)),  # raised the mark
        ((100, 1000, 0, 0), (300, 1000, 0, 0), (1000, False)),  # counters not kept
        # cudaMallocAsync: no cumulative counters; a phase that freed its temporaries
        # again must not read "nothing allocated, exact c0"
        ((100, 1000, -1, -1), (100, 1000, -1, -1), (1000, False)),
        ((100, 1000, -1, -1), (100, 1300, -1, -1), (1300, False)),
    ],
)
def test_phase_peak_cases(before, after, expected):
    assert phase_peak(before, after) == expected


def test_peak_reset_mode_is_exact_and_resets():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=4, peak_memory="reset")
    fake.alloc(1000 * MiB)
    fake.free(900 * MiB)
    slot = timer.begin()
    fake.alloc(200 * MiB)
    fake.free(200 * MiB)
    fake.alloc(30 * MiB)
    timer.end(slot)
    fake.finish_all()
    assert timer.poll(slot)[1] == 300 * MiB
    assert fake.resets == 1  # the trade-off: the process mark is gone
    assert fake.mem[1] == 300 * MiB


def test_peak_off_mode_reads_nothing():
    fake = FakeBackend()
    fake.memory = None  # any read would fail
    timer = GpuTimer(fake, pool_size=2, peak_memory="off")
    slot = timed_phase(timer, fake, 1.0)
    fake.finish_all()
    assert timer.poll(slot) == (1_000_000, -1, 0)


def test_bad_options_are_refused():
    with pytest.raises(ValueError):
        open_gpu_timer(pool_size=0, backend=FakeBackend())
    with pytest.raises(ValueError):
        open_gpu_timer(backend=FakeBackend(), peak_memory="sometimes")


# ---- opening ---------------------------------------------------------------------


def test_format_uuid_like_nvml():
    raw = types.SimpleNamespace(bytes=bytes(range(16)))
    assert format_uuid(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert (
        format_uuid("8F1C0000-1111-2222-3333-444444444444")
        == "GPU-8f1c0000-1111-2222-3333-444444444444"
    )
    assert (
        format_uuid("GPU-8F1C0000-1111-2222-3333-444444444444")
        == "GPU-8f1c0000-1111-2222-3333-444444444444"
    )


def test_open_returns_none_without_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert open_gpu_timer() is None
    assert "torch" not in sys.modules  # it did not import torch itself


def test_open_touches_only_is_initialized(monkeypatch):
    calls = []

    class Recorder(types.ModuleType):
        def __getattribute__(self, name):
            calls.append(name)
            if name == "is_initialized":
                return lambda: False
            raise AssertionError(f"torch.cuda.{name} used on a CPU-only run")

    fake_torch = types.ModuleType("torch")
    fake_torch.cuda = Recorder("torch.cuda")
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert open_gpu_timer() is None
    assert calls == ["is_initialized"]


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_import_and_open_without_torch_in_a_fresh_process():
    proc = _run("""
        import sys
        import markers.gpu as g
        assert g.open_gpu_timer() is None
        assert "torch" not in sys.modules, "markers.gpu imported torch"
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_open_with_real_torch_cpu_makes_no_cuda_calls():
    proc = _run("""
        import torch
        from markers.gpu import open_gpu_timer
        assert not torch.cuda.is_initialized()
        for _ in range(3):  # the Run asks at every iteration boundary
            assert open_gpu_timer() is None
        assert not torch.cuda.is_initialized(), "open_gpu_timer initialized CUDA"
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# ---- CUDA graph capture and allocator backends ------------------------------------


def test_phases_in_a_graph_capture_record_and_query_nothing():
    fake = FakeBackend()  # its record() and query() fail the test during a capture
    timer = GpuTimer(fake, pool_size=4)
    outside = timer.begin()  # begun before the capture, ended inside it
    fake.capture = True
    inside = timer.begin()
    timer.end(inside)
    timer.end(outside)
    assert inside == -1 and timer.captured == 2 and timer.dropped == 0
    assert fake.recorded == 2  # the anchor and the start event recorded before capture
    fake.capture = False
    fake.finish_all()
    assert timer.poll(outside) == NOT_MEASURED  # resolved: "GPU not measured"
    assert timer.poll(inside) == NOT_MEASURED
    assert timer.in_flight == 0
    after = timed_phase(timer, fake, 2.0)  # timing resumes after the capture
    fake.finish_all()
    assert timer.poll(after)[0] == 2_000_000


def test_drain_during_a_capture_queries_nothing():
    fake = FakeBackend()
    timer = GpuTimer(fake, pool_size=4)
    slot = timed_phase(timer, fake, 1.0)
    fake.finish_all()
    fake.capture = True
    assert timer.drain([slot], timeout_s=0.05) == [None]  # given up, never queried
    assert fake.queries == 0 and timer.dropped == 1


@pytest.mark.parametrize("mode", ["bound", "reset"])
def test_cuda_malloc_async_peaks_are_upper_bounds_never_exact(mode):
    fake = FakeBackend(exact_peaks=False)  # cumulative counters absent, as in PyTorch
    timer = GpuTimer(fake, pool_size=4, peak_memory=mode)
    fake.alloc(400 * MiB)
    fake.free(300 * MiB)  # earlier work: mark 400 MiB, 100 MiB held
    slot = timer.begin()
    fake.alloc(200 * MiB)  # a temporary ...
    fake.free(200 * MiB)  # ... freed again: current is back where it was
    timer.end(slot)
    fake.finish_all()
    _, peak, _ = timer.poll(slot)
    assert peak >= 300 * MiB  # never under the true peak (100 + 200 MiB)
    assert timer.inexact_peaks == 1  # and never flagged exact
