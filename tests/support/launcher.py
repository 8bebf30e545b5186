"""Runs the real ``sidecar`` command line with test seams plugged into its server: the
pynvml stand-in for machines without a GPU, a disk that fills. Production code reads no
test variable; tests start ``python -m tests.support.launcher [SEAMS] -- SIDECAR ARGS``.

    --fake-nvml NAME        open NVML through ``tests.support.fake_pynvml.NAME()``
    --disk-quota DIR:BYTES  writes under DIR fail with ENOSPC past BYTES (``disk_quota``)
    --slow-disk SECONDS     every file written takes SECONDS more (``slow_disk``)
    --exit-scrape PORT:FILE scrape /metrics on PORT into FILE at exit (``exit_scrape``)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sidecar import cli
from sidecar.resources.samplers import nvml
from tests.support import fake_pynvml
from tests.support.disk_quota import DiskQuota
from tests.support.exit_scrape import ExitScrape
from tests.support.slow_disk import SlowDisk


def seams(
    fake_nvml: str | None,
    disk_quota: str | None,
    slow_disk: float | None = None,
    exit_scrape: str | None = None,
) -> dict[str, Any]:
    """The ``Server`` keyword arguments for the options given."""
    result: dict[str, Any] = {}
    if fake_nvml:
        factory = getattr(fake_pynvml, fake_nvml)
        result["open_gpus"] = lambda visible, **kw: nvml.open_nvml(visible, api=factory(), **kw)
    if disk_quota:
        folder, _, size = disk_quota.rpartition(":")
        quota = DiskQuota(Path(folder), int(size))
        result["write_bytes"] = quota.write
    if slow_disk:
        result["write_bytes"] = SlowDisk(slow_disk).write
    if exit_scrape:
        port, _, into = exit_scrape.partition(":")
        # before the exporter the command line adds after the seams' hooks
        result["hooks"] = [ExitScrape(int(port), Path(into))]
    return result


def main(argv: list[str]) -> int:
    """Parse the seam options before ``--``; run the sidecar command line after it."""
    parser = argparse.ArgumentParser(prog="launcher")
    parser.add_argument("--fake-nvml")
    parser.add_argument("--disk-quota")
    parser.add_argument("--slow-disk", type=float)
    parser.add_argument("--exit-scrape")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    return cli.main(
        argv[split + 1 :],
        **seams(args.fake_nvml, args.disk_quota, args.slow_disk, args.exit_scrape),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
