"""The twins cannot drift: ``NullRun`` offers everything ``Run`` does, both offer the
whole ``RunInterface``, and the framework callbacks take exactly ``start_run``'s keywords.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from markers.interface import RunInterface
from markers.run import NullRun, Run
from markers.start import start_run
from markers.transport import Sender

HELLO = {"type": "hello", "accumulation_steps": 1}


def public_names(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def interface_names() -> set[str]:
    """The members ``RunInterface`` declares (methods, properties, attributes)."""
    declared = set(vars(RunInterface)) | set(RunInterface.__annotations__)
    return {n for n in declared if not n.startswith("_")} | {"__enter__", "__exit__"}


def test_null_run_has_every_public_name_of_a_real_run(tmp_path: Path) -> None:
    sender = Sender(f"ipc://{tmp_path}/none.sock", os.urandom(16), 0)  # nobody listens
    try:
        run = Run(sender, dict(HELLO), monitored=False)
        missing = public_names(run) - public_names(NullRun())
        assert not missing, f"NullRun lacks {sorted(missing)}"
        assert "prefer_device" in public_names(run)
        # run.phase is the table's C lookup: the hot path's name lookup adds no frame
        assert type(run.phase).__name__ == "builtin_function_or_method"
    finally:
        sender.close()


@pytest.mark.parametrize("cls", [Run, NullRun])
def test_both_runs_offer_the_whole_interface(cls: type) -> None:
    missing = {name for name in interface_names() if not hasattr(cls, name)}
    # Run.phase and Run.out_dir are set per instance (phase: the table's own lookup)
    assert missing <= ({"phase", "out_dir", "monitored"} if cls is Run else set())


def test_null_run_prefer_device_does_nothing() -> None:
    assert NullRun().prefer_device("cuda:0") is None


@pytest.mark.parametrize("module", ["lightning", "transformers"])
def test_callbacks_take_every_start_run_keyword(module: str) -> None:
    """Every keyword of start_run, ``device`` included, goes through the callbacks'
    constructors; an unknown one is a TypeError naming it."""
    pytest.importorskip(module)
    integration = __import__(f"markers.integrations.{module}", fromlist=["MonitorCallback"])
    values = {
        "out_dir": "maps",
        "split": 1,
        "warmup_iterations": 0,
        "num_measurements": 5,
        "train_batch_size": 2,
        "val_batch_size": 2,
        "accumulation_steps": 1,
        "resume": False,
        "endpoint": "ipc:///tmp/x.sock",
        "rank": 0,
        "device": "cpu",
        "flops_per_batch": 1e9,
        "flops_dtype": "fp32",
        "export": ("tensorboard",),
        "tensorboard_dir": "tb",
        "mlflow_experiment": "exp",
    }
    assert set(values) == set(inspect.signature(start_run).parameters)
    callback = integration.MonitorCallback(**values)
    assert callback.start_run_kwargs == values
    with pytest.raises(TypeError, match="warmup"):
        integration.MonitorCallback(warmup=3)
