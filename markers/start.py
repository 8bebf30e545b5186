"""``markers.start_run``: connect to a sidecar (or start a private one), announce the run
with its hello and hand back the ``Run`` (a ``NullRun`` when monitoring cannot even be
attempted); ``current_run`` is the run started last in this process.
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

from markers import exits, wire
from markers import secret as shared_secret
from markers.cuda import check_device_spec
from markers.endpoints import check, connect_address, ipc_path, private_endpoint
from markers.hello import FIELDS
from markers.hello import check as check_field
from markers.run import NullRun, Run
from markers.transport import Sender

VERSION = "0.1.0"  # the markers' version, sent in the hello (``markers.__version__``)

CONNECT_TIMEOUT_S = 5.0
PRIVATE_START_TIMEOUT_S = 20.0  # a fresh interpreter importing the sidecar on a busy machine

_current: list[Run | NullRun] = []  # the run started last in this process
# start_run calls per process id (a forked child starts its own count at 0)
_runs_started: dict[int, int] = {}


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


def _world_size() -> int:
    """The job's number of ranks (``WORLD_SIZE``, as torchrun and Slurm wrappers set it;
    1 when unset or not a positive integer): the sidecar expects ranks 0 … this − 1."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() and 0 < int(value) <= FIELDS["world_size"].high else 1


def _mlflow_run() -> dict[str, str | None]:
    """The script's active MLflow run: its id and tracking URI, from mlflow itself when
    the script imported it (never imported here: the markers stay light), else from
    ``MLFLOW_RUN_ID`` and ``MLFLOW_TRACKING_URI``; None for what is unknown."""
    run_id = os.environ.get("MLFLOW_RUN_ID") or None
    uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        # whatever a broken or odd mlflow raises must not stop the script
        with contextlib.suppress(Exception):
            active = mlflow.active_run()
            if active is not None:
                run_id = str(active.info.run_id)
            uri = str(mlflow.get_tracking_uri())
    return {"mlflow_run_id": run_id, "mlflow_tracking_uri": uri}


def _wandb_run() -> dict[str, str | None]:
    """The script's active W&B run (``wandb.run``, read only when the script imported
    wandb: the markers stay light): its project, and its group or else its id, as the
    group the sidecar's run joins; None for what is unknown."""
    project = group = None
    wandb = sys.modules.get("wandb")
    # whatever a broken or odd wandb raises must not stop the script
    with contextlib.suppress(Exception):
        active = getattr(wandb, "run", None) if wandb is not None else None
        if active is not None:
            project = str(active.project) or None
            group = str(active.group or active.id) or None
    return {"wandb_project": project, "wandb_group": group}


def _export_names(export: Any) -> list[str] | None:
    """``start_run``'s ``export`` as the hello's list (None: the sidecar's default); a
    single name may be given as a string. ValueError when it is not names."""
    if export is None:
        return None
    names = [export] if isinstance(export, str) else export
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"start_run: export must be names of exporters, got {export!r}")
    return list(names)


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "markers": VERSION}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)
    return versions


def _start_private_sidecar(secret: str) -> tuple[str, subprocess.Popen[bytes]]:
    """Start a sidecar for this process alone, serving only holders of ``secret``; it
    stops when we finish or die."""
    endpoint = private_endpoint()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar",
            "serve",
            "--quiet",
            "--endpoint",
            endpoint,
            "--owner-pid",
            str(os.getpid()),
        ],
        stdin=subprocess.DEVNULL,
        env={**os.environ, shared_secret.ENV: secret},
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


def _endpoint(given: str | None) -> tuple[str, str | None, subprocess.Popen[bytes] | None, float]:
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


def start_run(
    out_dir: str | os.PathLike[str] = "maps",
    split: int = FIELDS["split"].default,
    warmup_iterations: int = FIELDS["warmup_iterations"].default,
    num_measurements: int = FIELDS["num_measurements"].default,
    train_batch_size: int | None = FIELDS["train_batch_size"].default,
    val_batch_size: int | None = FIELDS["val_batch_size"].default,
    accumulation_steps: int = FIELDS["accumulation_steps"].default,
    resume: bool = FIELDS["resume"].default,
    endpoint: str | None = None,
    rank: int | None = None,
    device: Any = None,
    flops_per_batch: float | None = FIELDS["flops_per_batch"].default,
    flops_dtype: str = FIELDS["flops_dtype"].default,
    export: Any = FIELDS["export"].default,
    tensorboard_dir: str | os.PathLike[str] | None = FIELDS["tensorboard_dir"].default,
    mlflow_experiment: str | None = FIELDS["mlflow_experiment"].default,
) -> Run | NullRun:
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

    ``export`` names where the sidecar also writes the figures, step-aligned:
    ``("tensorboard", "mlflow")`` (default: the sidecar's ``--export``; ``()``: none).
    ``tensorboard_dir`` is the folder of the event files (default the split's
    ``tensorboard/``; relative to the working directory); ``mlflow_experiment`` the
    experiment of the MLflow run the sidecar creates when the script has no active one
    (default the run folder's name). An unknown name, or an exporter whose library the
    sidecar lacks, gives one warning naming the extra to install; the run goes on
    (``docs/exports.md``).

    Raises ValueError for a setting outside the hello's limits (``markers.hello``: a
    negative split or warmup, a cap, batch size or accumulation below 1, a ``resume``
    that is not a bool, an unknown ``flops_dtype``), FLOPs that are not a positive
    number, a negative rank, or a ``device`` that cannot name a CUDA device.
    """
    settings = {
        "split": split,
        "warmup_iterations": warmup_iterations,
        "num_measurements": num_measurements,
        "train_batch_size": train_batch_size,
        "val_batch_size": val_batch_size,
        "accumulation_steps": accumulation_steps,
        "resume": resume,
        "flops_per_batch": flops_per_batch,
        "flops_dtype": flops_dtype,
        "export": _export_names(export),
        "tensorboard_dir": None if tensorboard_dir is None else os.fspath(tensorboard_dir),
        "mlflow_experiment": mlflow_experiment,
    }
    for name, value in settings.items():
        try:
            check_field(name, value)
        except ValueError as exc:
            raise ValueError(f"start_run: {exc}") from None
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise ValueError(f"start_run: rank must be an integer >= 0 or None, got {rank!r}")
    if flops_per_batch is not None and not 0 < flops_per_batch < float("inf"):
        raise ValueError(
            f"start_run: flops_per_batch must be a positive number, got {flops_per_batch!r}"
        )
    check_device_spec(device)
    began_s = time.perf_counter()  # start_run's wait for the sidecar: start-up, not training
    try:
        endpoint, secret, private, timeout_s = _endpoint(endpoint)
        sender = Sender(endpoint, os.urandom(16), _rank(rank), secret)
    except (OSError, RuntimeError, ValueError, zmq.ZMQError) as exc:
        # A configuration we cannot use must never stop the training script.
        warnings.warn(
            f"markers: unusable sidecar configuration ({type(exc).__name__}: "
            f"{exc}); this run is not monitored, training goes on",
            RuntimeWarning,
            stacklevel=2,
        )
        _current[:] = [NullRun()]
        return _current[0]
    # Training time starts when the run is ready: a private sidecar's start-up is not training.
    connected = sender.wait_connected(timeout_s)
    start_unix, start_ns = time.time(), time.perf_counter_ns()
    # Reaching the sidecar (and starting a private one) takes tens of ms on a busy
    # machine: a later split's start-up, which begins at this call, not at the stamp.
    reach_s = time.perf_counter() - began_s
    earlier_runs = _runs_started.get(os.getpid(), 0)
    hello = {
        "type": wire.HELLO,
        "out_dir": os.fspath(out_dir),
        "cwd": os.getcwd(),
        **settings,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "user": getpass.getuser(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "command": [sys.executable, *sys.argv],
        "start_unix": start_unix,
        "start_ns": start_ns,
        "versions": _versions(),
        "sidecar_wait_s": reach_s if private is not None else 0.0,
        "start_run_s": reach_s,
        "earlier_runs": earlier_runs,
        "world_size": _world_size(),
        **_mlflow_run(),
        **_wandb_run(),
        "token": os.urandom(16).hex(),
    }
    _runs_started[os.getpid()] = earlier_runs + 1
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
        warnings.warn(
            f"markers: the sidecar at {endpoint} refused this run "
            f"({reply.get('error')}); this run is not monitored, training goes on",
            RuntimeWarning,
            stacklevel=2,
        )
        _current[:] = [NullRun()]
        return _current[0]
    monitored = reply is not None
    if reply is None:
        reason = (
            sender.last_failure
            if connected
            else (sender.refused or f"none connected within {timeout_s:.0f} s")
        )
        warnings.warn(
            f"markers: no answer from a sidecar at {endpoint} ({reason}); records "
            "are dropped and counted until one answers, training goes on",
            RuntimeWarning,
            stacklevel=2,
        )
    elif reply.get("warning"):
        warnings.warn(f"markers: {reply['warning']}", RuntimeWarning, stacklevel=2)
    first_epoch = reply.get("epoch") if reply is not None else 0
    run = Run(
        sender,
        hello,
        monitored,
        on_close,
        first_epoch if isinstance(first_epoch, int) else 0,
        device,
    )
    folder = reply.get("out_dir") if reply is not None else None
    run.out_dir = Path(folder) if isinstance(folder, str) else None
    exits.watch_exit()  # the status a run left open gets at exit is sys.exit's
    atexit.register(run.close_at_exit)
    _current[:] = [run]
    return run
