"""Importing markers stays light: the training process pays for pyzmq and nothing heavy
(no torch, no training framework: instrument() and the callbacks import them when used)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.helpers import env


def test_import_markers_loads_no_heavy_module() -> None:
    code = (
        "import sys, markers; print(','.join(m for m in ('torch', 'pandas', 'psutil', "
        "'numpy', 'pynvml', 'sidecar', 'lightning', 'pytorch_lightning', "
        "'transformers', 'accelerate', 'clinicadl', 'monai', 'ignite', 'mlflow', "
        "'tensorboard') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == ""
