"""``sidecar status`` shows per GPU whether NVML answers and which fields it does not
support (docs/contract.md, Node daemon), from a real daemon whose NVML is the test stand-in
(launcher seam).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.support.helpers import Sidecar, start_job, status_text, wait_for


def _gpus(sidecar: Sidecar) -> list[dict]:
    return sidecar.status()["samplers"]["gpus"]


def test_status_lists_each_gpu_and_its_unsupported_calls(
    serve: Callable[..., Sidecar], short_tmp: Path
) -> None:
    sidecar = serve(seams=("--fake-nvml", "gpu_without_energy"))
    wait_for(lambda: len(_gpus(sidecar)) == 2, 30, "NVML to open")
    assert all(
        not gpu["lost"] and "sm activity" in gpu["unsupported"] for gpu in _gpus(sidecar)
    )  # no GPM on these: known when a GPU is added
    stop_file = short_tmp / "stop"
    job = start_job(sidecar.endpoint, short_tmp, "--out-dir", "g", "--stop-file", str(stop_file))
    try:  # the energy call is found unsupported at the first sampling round
        wait_for(
            lambda: "energy" in _gpus(sidecar)[1]["unsupported"],
            30,
            "GPU 1's energy counter to show as unsupported",
        )
        assert "energy" not in _gpus(sidecar)[0]["unsupported"]
        text = status_text(sidecar.endpoint)
        line = next(line for line in text.splitlines() if "GPU-4e4e4e4e" in line)
        assert line.startswith("  GPU 1 NVIDIA Fake 1 GPU-4e4e4e4e: NVML answers; unsupported:")
        assert "energy (" in line and "sm activity (GPM" in line
        view = json.loads(status_text(sidecar.endpoint, "--json"))
        assert [gpu["uuid"] for gpu in view["samplers"]["gpus"]] == ["GPU-3d3d3d3d", "GPU-4e4e4e4e"]
    finally:
        stop_file.touch()
        job.wait(60)
