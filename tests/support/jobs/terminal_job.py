"""A job that uses the terminal as a person at it would: it reads a line with input(),
trains until Ctrl-C (caught: it goes on), stops in pdb (breakpoint()), then ends its run.
Run under ``sidecar run`` in a pseudo-terminal by ``tests/e2e/test_terminal.py``.
"""

from __future__ import annotations

import os
import time

import markers


def main() -> None:
    with markers.start_run(out_dir="maps", warmup_iterations=0) as run:
        print(f"ready {os.getpid()}", flush=True)
        name = input("name? ")
        print(f"hello {name}", flush=True)
        try:
            with run.epoch():
                print("training", flush=True)
                for _ in run.train_batches(iter(int, 1)):  # until Ctrl-C
                    with run.phase("forward"):
                        time.sleep(0.002)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        breakpoint()  # the test types a pdb command, then "c"
        print("leaving", flush=True)


if __name__ == "__main__":
    main()
