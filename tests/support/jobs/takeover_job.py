"""A job whose sidecar is replaced while it runs, with 1000 custom phases named while no
sidecar listens (the markers' queue fills and declarations are dropped on the way).

    python takeover_job.py OUT_DIR STATE_DIR

It creates files in STATE_DIR as it goes: ``checkpointed`` once the first sidecar wrote a
checkpoint (then it waits for ``go``), ``declared`` once the 1000 names were used (the
test starts the new sidecar then); it runs rounds using every name until ``stop``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import markers

NAMES = [f"name {i:04d}" for i in range(1000)]


def wait(path: Path) -> None:
    while not path.exists():
        time.sleep(0.02)


def main() -> None:
    out_dir, state = sys.argv[1], Path(sys.argv[2])
    with markers.start_run(out_dir=out_dir, warmup_iterations=0, num_measurements=1000) as run:
        for _ in run.train_batches(range(3)):
            with run.phase("early"):  # declared to the first sidecar only
                time.sleep(0.002)
        assert run.checkpoint()
        (state / "checkpointed").touch()
        wait(state / "go")  # the first sidecar is gone now
        for name in NAMES:
            with run.phase(name):
                pass
        (state / "declared").touch()
        while not (state / "stop").exists():
            for _ in run.train_batches(range(2)):
                with run.phase("early"):
                    time.sleep(0.002)
            for name in NAMES:
                with run.phase(name):
                    pass
            time.sleep(0.05)


if __name__ == "__main__":
    main()
