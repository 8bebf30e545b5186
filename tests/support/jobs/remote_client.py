"""A training process that says it runs on another host (``--host``), so the sidecar can
watch it only through its connection: it says hello, sends records every 50 ms (or
nothing with ``--idle``) for ``--seconds``, then finishes its run. Prints ``ready`` once
the sidecar answered its hello, ``finished <ok>`` at the end.
"""

from __future__ import annotations

import argparse
import os
import time

from markers import wire
from markers.transport import Sender
from tests.support.frames import records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--host", default="node-b")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--idle", action="store_true")
    args = parser.parse_args()
    sender = Sender(args.endpoint, os.urandom(16), 0)
    hello = {
        "type": wire.HELLO,
        "out_dir": args.out_dir,
        "cwd": "/",
        "split": 0,
        "warmup_iterations": 0,
        "num_measurements": 100_000,
        "host": args.host,
        "pid": os.getpid(),
        "start_ns": time.perf_counter_ns(),
    }
    reply = sender.request(hello, 20.0, connect_timeout_s=20.0)
    assert reply and reply["ok"], reply
    print("ready", flush=True)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        if not args.idle:
            sender.send_records(records(5), 5)
        time.sleep(0.05)
    reply = sender.request(
        {"type": wire.FINISH, "status": "completed", "end_ns": time.perf_counter_ns()}, 20.0
    )
    print(f"finished {bool(reply and reply['ok'])}", flush=True)
    sender.close()


if __name__ == "__main__":
    main()
