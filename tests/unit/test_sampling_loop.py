"""The sidecar's loop while a GPU is slow: NVML rounds run off the loop and are never
waited for, so records keep being received and aggregated, the other GPUs keep their
cadence, and the slow GPU comes back when it speeds up. A real server (ZeroMQ socket,
receiver, aggregator, psutil on this process) with 8 fake GPUs."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import zmq

from sidecar.daemon.server import Config, Server
from sidecar.resources.samplers.nvml import open_nvml
from tests.support.fake_pynvml import FakeGpu, FakeNvml
from tests.support.frames import Client

SLOW_CALL_S = 2.0  # twice the round timeout: every reading of the slow GPU is given up
INTERVAL_S = 0.2


def _producer(endpoint: str, out_dir: str, stop: threading.Event) -> None:
    """A run's hello, then 10 records every 20 ms until ``stop``."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    client = Client()
    dealer.send(client.hello(out_dir))
    while not stop.wait(0.02):
        dealer.send(client.records(10))
    dealer.close(linger=1000)


def test_a_slow_gpu_holds_up_neither_the_loop_nor_the_other_gpus(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu(uuid=f"GPU-{i}{i}{i}{i}ffff") for i in range(8)])
    slow = fake.gpus[5]
    slow.slow = {"nvmlDeviceGetMemoryInfo": SLOW_CALL_S}
    endpoint = f"ipc://{tmp_path}/s.sock"
    server = Server(
        Config(endpoint, interval_s=INTERVAL_S),
        open_gpus=lambda visible, **kw: open_nvml(visible, api=fake, **kw),
    )
    stop = threading.Event()
    producer = threading.Thread(
        target=_producer, args=(endpoint, str(tmp_path / "job"), stop), daemon=True
    )
    producer.start()
    try:
        while not server.monitor.splits or server.monitor.gpus is None:
            server.turn()
        ((_, resources),) = server.monitor.splits.values()
        # While GPU 5's calls take 2 s: each turn of the loop on its own clock, and the
        # records it received by the end of it.
        turns: list[tuple[float, int]] = []
        began = time.monotonic()
        while time.monotonic() - began < 2.5 * SLOW_CALL_S:
            start = time.monotonic()
            server.turn()
            turns.append((time.monotonic() - start, server.registry.records_received))
        missed = server.monitor.gpu_status()[5]
        assert missed["missed_rounds"] >= 2 and missed["stuck_calls"] >= 1
        # a loop that waited for the round would stop 1 s (the deadline) in some turns
        assert max(seconds for seconds, _ in turns) < 0.6
        received = [count for _, count in turns]
        growing = sum(1 for a, b in itertools.pairwise(received) if b > a)
        assert growing >= 20  # records came in turn after turn while GPU 5 was slow
        stamps = {s.t_ns for s in resources.host_samples[1:]}  # the rounds (the first: watch)
        by_gpu = {i: {s.t_ns for s in resources.gpu_samples if s.gpu_index == i} for i in range(8)}
        taken = set().union(*by_gpu.values())
        assert len(taken) >= 15  # ~25 rounds at 0.2 s; the last few may still be out
        for i in (0, 1, 2, 3, 4, 6, 7):  # the other GPUs: a sample in every round taken in
            assert by_gpu[i] == taken, i
        assert len(by_gpu[5]) <= 2  # GPU 5 answered no round after its first readings
        assert stamps >= taken
        # GPU 5 speeds up: its stuck calls come back and it is sampled again
        slow.slow = {}
        sped_up_ns = time.monotonic_ns()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
            s.gpu_index == 5 and s.t_ns > sped_up_ns for s in resources.gpu_samples
        ):
            server.turn()
        assert any(s.gpu_index == 5 and s.t_ns > sped_up_ns for s in resources.gpu_samples)
        assert resources.gpu_ts == sorted(resources.gpu_ts)  # taken in in time order
    finally:
        stop.set()
        producer.join(5)
        fake.release.set()
        server.receiver.close()
        server.monitor.close()
