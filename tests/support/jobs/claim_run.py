"""A neighbour's attempt on someone else's run, for the shared-node tests: a hello that
names the run id given on the command line, from a process that does not hold that run's
token. Prints the sidecar's reply as JSON (null when none came)."""

from __future__ import annotations

import argparse
import json
import os
import time

from markers import wire
from markers.transport import Sender


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("run_id", help="hex")
    parser.add_argument("--out-dir", default="stolen")
    args = parser.parse_args()
    sender = Sender(args.endpoint, bytes.fromhex(args.run_id), 0)
    try:
        reply = sender.request(
            {
                "type": wire.HELLO,
                "out_dir": args.out_dir,
                "cwd": os.getcwd(),
                "pid": os.getpid(),
                "repeat": True,
                "resume": True,
                "start_unix": time.time(),
                "start_ns": time.perf_counter_ns(),
                "token": os.urandom(16).hex(),
            },
            10.0,
            connect_timeout_s=10.0,
        )
    finally:
        sender.close()
    print(json.dumps(reply))


if __name__ == "__main__":
    main()
