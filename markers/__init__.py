"""Light phase markers for PyTorch training loops; a sidecar process does the rest.

    import markers
    with markers.start_run(out_dir="maps", split=0) as run:
        for epoch in range(n_epochs):
            with run.epoch():
                for batch in run.train_batches(loader):
                    with run.phase("forward"): ...

Importing this package loads pyzmq and the standard library only: no torch, pandas or
psutil (torch is used only when the training script already imported it). This module
only re-exports the public API.
"""

from __future__ import annotations

from markers.instrument import Instrumentation, instrument
from markers.interface import RunInterface
from markers.phase import Phase
from markers.run import NullRun, Run
from markers.start import VERSION, current_run, start_run

__all__ = [
    "Instrumentation",
    "NullRun",
    "Phase",
    "Run",
    "RunInterface",
    "current_run",
    "instrument",
    "start_run",
]
__version__ = VERSION
