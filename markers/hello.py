"""The hello's fields, declared once: their types, limits and defaults.

A run announces itself with a ``hello`` control (``markers.wire.HELLO``). ``start_run``
checks its arguments against ``FIELDS`` and the sidecar checks every hello it receives
against the same table (``sidecar.daemon.schema``), then reads the aggregation settings
with ``setting``: one set of limits and defaults on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from markers.wire import FLOPS_DTYPES

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
PID_MAX = 2**22  # the kernel's upper bound of pid_max
TEXT_MAX = 4096  # paths, commands' words
NAME_MAX = 256  # host names, user names, job ids, version strings
EXPORTS_MAX = 8  # names in a hello's ``export`` list


@dataclass(frozen=True)
class HelloField:
    """One hello field. ``kind`` is ``int`` (an integer, not a bool, in ``low..high``),
    ``text`` (a string of ``low..high`` characters), ``flag`` (a bool), ``number`` (an int
    or float), ``choice`` (one of ``choices``), ``words`` (a list of strings of at most
    ``TEXT_MAX`` characters, at most ``high`` of them), ``names`` (a mapping of strings of
    at most ``high`` characters, at most 64 entries) or ``any`` (its handler checks it).
    ``default`` is the value a hello without the field means."""

    kind: str
    required: bool = False
    nullable: bool = False
    low: int = 0
    high: int = INT64_MAX
    default: Any = None
    choices: tuple[str, ...] = ()


FIELDS: dict[str, HelloField] = {
    "out_dir": HelloField("text", required=True, low=1, high=TEXT_MAX),
    "cwd": HelloField("text", low=1, high=TEXT_MAX),
    "split": HelloField("int", high=INT32_MAX, default=0),
    "warmup_iterations": HelloField("int", default=10),
    "num_measurements": HelloField("int", low=1, default=100),
    "train_batch_size": HelloField("int", nullable=True, low=1, high=INT32_MAX),
    "val_batch_size": HelloField("int", nullable=True, low=1, high=INT32_MAX),
    "accumulation_steps": HelloField("int", low=1, high=INT32_MAX, default=1),
    "resume": HelloField("flag", default=False),
    "repeat": HelloField("flag", default=False),  # a re-announcement of a running run
    # drawn per run and known only to its process: the run id stays its own
    "token": HelloField("text", nullable=True, high=NAME_MAX),
    "host": HelloField("text", nullable=True, high=NAME_MAX),
    "pid": HelloField("int", high=PID_MAX),
    "user": HelloField("text", nullable=True, high=NAME_MAX),
    "job_id": HelloField("text", nullable=True, high=NAME_MAX),
    "command": HelloField("words", nullable=True, high=4096),
    "start_unix": HelloField("number", nullable=True),
    "start_ns": HelloField("int"),
    "versions": HelloField("names", nullable=True, high=NAME_MAX),
    "phases": HelloField("any"),  # custom names -> ids: checked by the sidecar's streams
    "worker_phases": HelloField("int", default=0),
    # seconds start_run waited for the private sidecar it started (0: none started)
    "sidecar_wait_s": HelloField("number", default=0.0),
    # seconds start_run spent before ``start_unix`` (reaching the sidecar, starting a
    # private one): a later run's start-up, which begins at its own start_run
    "start_run_s": HelloField("number", default=0.0),
    # start_run calls this process made before this one (k-fold splits in one process): the
    # process's start is then the first run's start-up, not this one's
    "earlier_runs": HelloField("int", default=0),
    # the model FLOPs of one training batch, for the MFU estimate (None: not asked)
    "flops_per_batch": HelloField("number", nullable=True),
    "flops_dtype": HelloField("choice", default="bf16", choices=FLOPS_DTYPES),
    "world_size": HelloField("int", low=1, high=INT32_MAX, default=1),  # ranks 0 … n − 1 expected
    # Exports of the figures (``sidecar.exports``): the names asked for, checked by the
    # sidecar, which warns of an unknown one; None: the sidecar's ``--export`` default.
    "export": HelloField("words", nullable=True, high=EXPORTS_MAX),
    "tensorboard_dir": HelloField("text", nullable=True, low=1, high=TEXT_MAX),
    "mlflow_experiment": HelloField("text", nullable=True, low=1, high=NAME_MAX),
    # the script's active MLflow run, when it has one (sent without importing mlflow)
    "mlflow_run_id": HelloField("text", nullable=True, low=1, high=NAME_MAX),
    "mlflow_tracking_uri": HelloField("text", nullable=True, low=1, high=TEXT_MAX),
    # the script's active W&B run, when it has one: its project and group (its id when
    # it has none), where the sidecar's W&B run goes beside it
    "wandb_project": HelloField("text", nullable=True, low=1, high=NAME_MAX),
    "wandb_group": HelloField("text", nullable=True, low=1, high=NAME_MAX),
}

# The fields that are aggregation settings (``start_run``'s arguments of the same names).
SETTINGS = (
    "warmup_iterations",
    "num_measurements",
    "train_batch_size",
    "val_batch_size",
    "accumulation_steps",
)


def accepts(field: HelloField, value: Any) -> bool:
    """True when ``value`` (present) is acceptable for ``field``."""
    if value is None:
        return field.nullable
    kind = field.kind
    if kind == "int":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and field.low <= value <= field.high
        )
    if kind == "text":
        return isinstance(value, str) and field.low <= len(value) <= field.high
    if kind == "flag":
        return isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "choice":
        return value in field.choices
    if kind == "words":
        return (
            isinstance(value, list)
            and len(value) <= field.high
            and all(isinstance(w, str) and len(w) <= TEXT_MAX for w in value)
        )
    if kind == "names":
        return (
            isinstance(value, dict)
            and len(value) <= 64
            and all(
                isinstance(k, str)
                and isinstance(x, str)
                and len(k) <= field.high
                and len(x) <= field.high
                for k, x in value.items()
            )
        )
    return kind == "any"


def limits(name: str) -> str:
    """What ``name`` may hold, in words (for error messages)."""
    field = FIELDS[name]
    if field.kind == "choice":
        return f"one of {', '.join(field.choices)}"
    if field.kind != "int":
        return f"a {field.kind}"
    upper = f" and <= {field.high}" if field.high < INT64_MAX else ""
    none = " or None" if field.nullable else ""
    return f"an integer >= {field.low}{upper}{none}"


def check(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is acceptable for the hello field ``name``."""
    if not accepts(FIELDS[name], value):
        raise ValueError(f"{name} must be {limits(name)}, got {value!r}")


def setting(body: dict[str, Any], name: str) -> Any:
    """The value of field ``name`` in the hello ``body``, its default when absent.

    Raises ValueError when the value is not acceptable.
    """
    value = body.get(name, FIELDS[name].default)
    check(name, value)
    return value
