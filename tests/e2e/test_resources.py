"""Resource sampling end to end: ``sidecar run`` samples the job's processes and GPUs and
attributes GPU use to phases in summary.log and resources.tsv. The GPUs are the small
pynvml stand-in (through the test launcher): the sidecar's whole sampling path runs for real.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.helpers import env, read_tsv, sidecar_command

LOOP = textwrap.dedent("""
    import time
    import markers

    with markers.start_run(out_dir="maps", warmup_iterations=0, train_batch_size=4) as run:
        for _ in range(2):
            with run.epoch():
                for _batch in run.train_batches([[0] * 4] * 40):
                    with run.phase("forward"):
                        time.sleep(0.01)
                    with run.phase("backward"):
                        time.sleep(0.01)
""")


def test_sidecar_run_samples_gpus_and_attributes_them_to_phases(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    result = subprocess.run(
        sidecar_command(
            "run",
            "--quiet",
            "--interval",
            "0.2",
            "--",
            sys.executable,
            str(script),
            seams=["--fake-nvml", "two_busy_gpus"],
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    split = tmp_path / "maps" / "training" / "split-0"
    summary = (split / "summary.log").read_text()
    assert "GPU 0: 'NVIDIA Fake 0' GPU-0a0a0a0a" in summary
    assert "GPU 1: 'NVIDIA Fake 1' GPU-1b1b1b1b" in summary
    assert "GPU utilization and power during each phase" in summary
    for phase in ("Forward", "Backward", "Training loop"):
        row = re.search(rf"^{phase} +\| +(\d+\.\d+) \| +(\d+) \| +(\d+\.\d) \|", summary, re.M)
        assert row is not None, phase
        covered_s, samples, util = float(row[1]), int(row[2]), float(row[3])
        assert covered_s > 0.3 and samples >= 2 and 10 <= util <= 90
    assert "Host: job processes" in summary
    frame = read_tsv(split / "logs" / "resources.tsv")
    assert set(frame["gpu uuid"].dropna()) == {"GPU-0a0a0a0a", "GPU-1b1b1b1b"}
    util = frame["utilization (%)"].dropna()
    assert util.between(0, 100).all() and 30 < util.mean() < 90  # busy 60 % of the time
    assert (frame["job memory rss (MB)"].dropna() > 5).all()
    assert frame["time (s)"].is_monotonic_increasing
