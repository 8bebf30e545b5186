"""One W&B run of the sidecar's exporter (``sidecar.exports.wandb``), offline, in a process
of its own (W&B's service is a child of it): five Forward rows exported, then, with
``kill``, W&B's service killed before the run is finished, as a sidecar's exit tears it
down beneath a finish under way. Prints the exporter's counts as JSON.

``python -m tests.support.wandb_finish OUT_DIR kill|keep`` (``WANDB_MODE=offline``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil

from markers import wire
from sidecar.exports.points import Slice
from sidecar.exports.wandb import WandbExporter
from sidecar.model.series import Row

ROWS = 5


def main(out: Path, kill: bool) -> None:
    """Export ``ROWS`` Forward rows into one run, kill W&B's service when ``kill``, then
    close the exporter (the run's finish) and print its counts."""
    split_dir = out / "training" / "split-0"
    split_dir.mkdir(parents=True, exist_ok=True)
    rows = [
        Row(0.1, None, None, epoch=0, iteration=i, batch=i, session=0, start_s=float(i))
        for i in range(ROWS)
    ]
    part = Slice(
        split_dir=split_dir,
        out_dir=out,
        lineage="lineage",
        rows={(wire.FORWARD, "forward"): rows},
        first_steps={0: 0},
        session_starts=[(time.time(), 0)],
        earlier_rows={},
        run_start_unix=time.time(),
        timeline=(np.zeros(0), np.zeros(0, dtype=np.int64)),
        gpu_samples=[],
        host_samples=[],
        run_start_ns=0,
        step_now=ROWS,
        now_unix=time.time(),
        cpu_count=1,
        rank_gpu_index=0,
        final=True,
        status="completed",
    )
    exporter = WandbExporter(
        {"name": "finish", "split": 0, "split_dir": split_dir, "wandb_project": "finish"}
    )
    exporter.export(part)
    logged = {"exported": exporter.exported, "awaiting": exporter.awaiting}
    if kill:
        service = [p for p in psutil.Process().children(recursive=True)]
        for process in service:
            process.kill()
        psutil.wait_procs(service, timeout=30)
    exporter.close()
    counts = {
        "exported": exporter.exported,
        "awaiting": exporter.awaiting,
        "dropped": exporter.dropped,
        "unconfirmed": exporter.unconfirmed,
        "error": exporter.error,
        "where": exporter.where(),
    }
    print(json.dumps({"logged": logged, "closed": counts}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "kill")
