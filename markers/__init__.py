"""Light phase markers for PyTorch training loops; a sidecar process does the rest.

    import markers
    with markers.start_run(out_dir="maps", split=0) as run:
        for epoch in range(n_epochs):
            with run.epoch():
                for batch in run.train_batches(loader):
                    with run.phase("forward"): ...

Importing this package loads pyzmq and the standard library only: no torch, pandas or
psutil (torch is used only when the training script already imported it).
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import zmq

from markers import secret as shared_secret
from markers import wire
from markers.cuda import check_device_spec
from markers.endpoints import check, connect_address, ipc_path, private_endpoint
from markers.instrument import Instrumentation, instrument
from markers.run import NullRun, Phase, Run
from markers.transport import Sender

__all__ = ["Instrumentation", "NullRun", "Phase", "Run", "current_run", "instrument",
           "start_run"]
__version__ = "0.1.0"

CONNECT_TIMEOUT_S = 5.0
PRIVATE_START_TIMEOUT_S = 20.0  # a fresh interpreter importing the sidecar on a busy machine

_current: list[Run | NullRun] = []  # the run started last in this process


def current_run() -> Run | NullRun | None:
    """The run ``start_run`` returned last in this process (None before any): what
    ``instrument()`` uses when it is not given a run."""
    return _current[-1] if _current else None


def _rank(given: int | None = None) -> int:
    if given is not None:
        return given
    for variable in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(variable, "")
        if value.isdigit():
            return int(value)
    return 0


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "markers": __version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)
    return versions


def _start_private_sidecar(secret: str) -> tuple[str, subprocess.Popen[bytes]]:
    """Start a sidecar for this process alone, serving only holders of ``secret``; it
    stops when we finish or die."""
    endpoint = private_endpoint()
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--quiet", "--endpoint", endpoint,
         "--owner-pid", str(os.getpid())],
        stdin=subprocess.DEVNULL, env={**os.environ, shared_secret.ENV: secret},
        start_new_session=True,  # a Ctrl-C to the job must not kill it before it writes
    )
    return endpoint, process


def _stop_private_sidecar(endpoint: str, process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        process.kill()
    socket_file = ipc_path(endpoint)
    with contextlib.suppress(OSError):  # not empty or already gone: leave it
        if socket_file is not None:
            socket_file.parent.rmdir()


def _check(name: str, value: int | None, low: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < low):
        raise ValueError(f"start_run: {name} must be an integer >= {low}, got {value!r}")


def _endpoint(given: str | None) -> tuple[str, str | None, subprocess.Popen[bytes] | None,
                                         float]:
    """Where to connect, the secret to show there (None: none), the private sidecar
    started for it (or None) and how long to wait for it. Raises ValueError for an
    endpoint that cannot be used, OSError or UnsafeFolder (a RuntimeError) for an unusable
    runtime folder.
    """
    from_environment = os.environ.get("SIDECAR_ENDPOINT")
    endpoint = given or from_environment
    if endpoint:
        # The secret goes with the endpoint `sidecar run` set, never to another sidecar.
        secret = os.environ.get(shared_secret.ENV) if endpoint == from_environment else None
        return connect_address(check(endpoint)), secret, None, CONNECT_TIMEOUT_S
    secret = shared_secret.new()
    endpoint, private = _start_private_sidecar(secret)
    return endpoint, secret, private, PRIVATE_START_TIMEOUT_S


def start_run(out_dir: str | os.PathLike[str] = "maps", split: int = 0,
              warmup_iterations: int = 10, num_measurements: int = 100,
              train_batch_size: int | None = None, val_batch_size: int | None = None,
              accumulation_steps: int = 1, resume: bool = False,
              endpoint: str | None = None, rank: int | None = None,
              device: Any = None, flops_per_batch: float | None = None,
              flops_dtype: str = "bf16") -> Run | NullRun:
    """Start monitoring one split of a training run and return its ``Run``.

    Connects to the sidecar at ``endpoint``, else ``$SIDECAR_ENDPOINT``, else starts a
    private sidecar subprocess. Returns once the sidecar acknowledged the run (a few
    seconds at most); when none answers, one RuntimeWarning says so and the run goes on
    unmonitored (records are dropped and counted; a sidecar that appears later on the
    endpoint picks the run up). ``resume`` continues the split from the state the sidecar
    saved at the last ``checkpoint()``. ``rank`` is the process's rank in a distributed
    run (default: ``$RANK``, else ``$LOCAL_RANK``, else 0; framework callbacks pass the
    trainer's). Times are measured with ``time.perf_counter_ns``.

    ``device`` says which CUDA device GPU timing uses: an index, ``"cuda:N"``, a
    ``torch.device``, a tensor, or the model (where its parameters live). Without it the
    device where the process holds memory is timed, else ``LOCAL_RANK``'s, else the
    current one (``docs/gpu-timing.md``).

    An endpoint or runtime folder that cannot be used at all gives one RuntimeWarning and a
    ``NullRun`` (the same interface; nothing is measured).

    ``flops_per_batch`` (the model FLOPs of one training batch, forward and backward:
    given, or ``markers.flops.count_flops_per_batch``) asks for the MFU estimate against the
    device's dense peak for ``flops_dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``,
    ``fp8``).

    Raises ValueError for a negative warmup, a cap, batch size or accumulation below 1,
    a ``device`` that cannot name a CUDA device, FLOPs that are not a positive number or an
    unknown ``flops_dtype``.
    """
    _check("split", split, 0)
    _check("warmup_iterations", warmup_iterations, 0)
    _check("num_measurements", num_measurements, 1)
    _check("train_batch_size", train_batch_size, 1)
    _check("val_batch_size", val_batch_size, 1)
    _check("accumulation_steps", accumulation_steps, 1)
    _check("rank", rank, 0)
    check_device_spec(device)
    if flops_per_batch is not None and (isinstance(flops_per_batch, bool) or not isinstance(
            flops_per_batch, (int, float)) or not 0 < flops_per_batch < float("inf")):
        raise ValueError(f"start_run: flops_per_batch must be a positive number, got "
                         f"{flops_per_batch!r}")
    if flops_dtype not in wire.FLOPS_DTYPES:
        raise ValueError(f"start_run: flops_dtype must be one of {wire.FLOPS_DTYPES}, got "
                         f"{flops_dtype!r}")
    began_s = time.perf_counter()  # a private sidecar's start: start-up, not training
    try:
        endpoint, secret, private, timeout_s = _endpoint(endpoint)
        sender = Sender(endpoint, os.urandom(16), _rank(rank), secret)
    except (OSError, RuntimeError, ValueError, zmq.ZMQError) as exc:
        # A configuration we cannot use must never stop the training script.
        warnings.warn(f"markers: unusable sidecar configuration ({type(exc).__name__}: "
                      f"{exc}); this run is not monitored, training goes on", RuntimeWarning,
                      stacklevel=2)
        _current[:] = [NullRun()]
        return _current[0]
    # Training time starts when the run is ready: a private sidecar's start-up is not training.
    connected = sender.wait_connected(timeout_s)
    hello = {
        "type": wire.HELLO, "out_dir": os.fspath(out_dir), "cwd": os.getcwd(), "split": split,
        "warmup_iterations": warmup_iterations, "num_measurements": num_measurements,
        "train_batch_size": train_batch_size, "val_batch_size": val_batch_size,
        "accumulation_steps": accumulation_steps, "resume": resume,
        "host": socket.gethostname(), "pid": os.getpid(), "user": getpass.getuser(),
        "job_id": os.environ.get("SLURM_JOB_ID"), "command": [sys.executable, *sys.argv],
        "start_unix": time.time(), "start_ns": time.perf_counter_ns(), "versions": _versions(),
        "sidecar_wait_s": time.perf_counter() - began_s if private is not None else 0.0,
        "flops_per_batch": flops_per_batch, "flops_dtype": flops_dtype,
    }
    reply = sender.request(hello, timeout_s) if connected else None
    on_close = None
    if private is not None:
        def on_close() -> None:
            _stop_private_sidecar(endpoint, private)
    if reply is not None and not reply.get("ok"):
        # Refused (an out_dir it may not write, a malformed hello): nothing this run sends
        # would be kept, so it sends nothing more.
        sender.close()
        if on_close is not None:
            on_close()
        warnings.warn(f"markers: the sidecar at {endpoint} refused this run "
                      f"({reply.get('error')}); this run is not monitored, training goes on",
                      RuntimeWarning, stacklevel=2)
        _current[:] = [NullRun()]
        return _current[0]
    monitored = reply is not None
    if not monitored:
        reason = sender.last_failure if connected else (f"none connected within "
                                                        f"{timeout_s:.0f} s")
        warnings.warn(f"markers: no answer from a sidecar at {endpoint} ({reason}); records "
                      "are dropped and counted until one answers, training goes on",
                      RuntimeWarning, stacklevel=2)
    elif reply.get("warning"):
        warnings.warn(f"markers: {reply['warning']}", RuntimeWarning, stacklevel=2)
    first_epoch = reply.get("epoch") if reply else 0
    run = Run(sender, hello, monitored, on_close,
              first_epoch if isinstance(first_epoch, int) else 0, device)
    folder = reply.get("out_dir") if reply else None
    run.out_dir = Path(folder) if isinstance(folder, str) else None
    atexit.register(run.close_at_exit)
    _current[:] = [run]
    return run
