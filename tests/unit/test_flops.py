"""The FLOPs counter's meta copy costs no weight memory (a subprocess's own peak RSS)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.helpers import env

pytest.importorskip("torch")

SCRIPT = """
import resource, torch
from markers.flops import count_flops_per_batch
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)])  # 256 MiB
torch.nn.init.normal_(model[0].weight)
model.register_buffer("table", torch.ones(4096, 4096))  # 64 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
flops = count_flops_per_batch(model, torch.zeros(2, 2048))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert flops == 3 * 2 * 2 * 2048 * 2048 * 16 - 2 * 2 * 2048 * 2048, flops
assert next(model.parameters()).device.type == "cpu"
print((after - before) / 1024)
"""


def test_the_meta_copy_does_not_copy_the_weights() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    grown_mib = float(result.stdout)
    # A deepcopy on the model's device adds its 320 MiB to the peak; what the counter
    # itself loads (FlopCounterMode, autograd on meta) is about 80 MiB.
    assert grown_mib < 160, f"peak RSS grew {grown_mib:.0f} MiB"
