"""What a hello says, checked: the run folder asked for, the split, the aggregation
settings, the process's start and its custom phases. WireError("malformed") for a value
that is wrong; ``Refused`` is raised by whoever will not serve a well-formed hello.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from markers import hello as schema
from markers import wire
from sidecar.model.aggregator import Settings

# What a hello tells of the run, kept in the split's metadata (run.json, summary).
INFO_FIELDS = (
    "host",
    "user",
    "job_id",
    "command",
    "cwd",
    "versions",
    "flops_per_batch",
    "flops_dtype",
    "world_size",
    # what the run asked to export (sidecar.exports)
    "export",
    "tensorboard_dir",
    "mlflow_experiment",
    "mlflow_run_id",
    "mlflow_tracking_uri",
    "wandb_project",
    "wandb_group",
)


class Refused(Exception):
    """A hello the sidecar will not serve (e.g. an out_dir outside ``--root``, a split
    another live run writes)."""


def _int(body: dict[str, Any], key: str, default: int | None = None, low: int = 0) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise wire.WireError("malformed", f"hello field {key!r} must be an integer >= {low}")
    return value


def phase_id(value: Any) -> int:
    """A custom phase id; WireError("malformed") when out of range."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not wire.FIRST_CUSTOM_ID <= value <= wire.MAX_PHASE_ID
    ):
        raise wire.WireError(
            "malformed",
            f"a custom phase id must lie in {wire.FIRST_CUSTOM_ID}"
            f"-{wire.MAX_PHASE_ID}, got {value!r}",
        )
    return value


def phase_name(value: Any) -> str:
    """A custom phase name; WireError("malformed") for one that is not a string, empty,
    too long or a standard label's."""
    if not isinstance(value, str):
        raise wire.WireError("malformed", "a custom phase name must be a string")
    try:
        return wire.custom_phase_name(value)
    except ValueError as exc:
        raise wire.WireError("malformed", f"custom phase name refused: {exc}") from None


def settings_from_hello(body: dict[str, Any]) -> Settings:
    """The aggregation settings in a hello (``markers.hello``'s defaults for those it
    lacks); WireError("malformed") when a value is outside the hello's limits."""
    try:
        return Settings(**{name: schema.setting(body, name) for name in schema.SETTINGS})
    except ValueError as exc:
        raise wire.WireError("malformed", f"hello field {exc}") from None


def declarations(body: dict[str, Any]) -> dict[int, str]:
    """The ``phases`` map of a hello (name -> id) as id -> name; WireError if bad."""
    phases = body.get("phases", {})
    if not isinstance(phases, dict) or len(phases) > wire.MAX_CUSTOM_PHASES:
        raise wire.WireError(
            "malformed", f"hello 'phases' must map at most {wire.MAX_CUSTOM_PHASES} names to ids"
        )
    return {phase_id(number): phase_name(name) for name, number in phases.items()}


@dataclass(frozen=True)
class Hello:
    """The first hello of a process, checked (``parse``)."""

    out_dir: str  # as asked: placed by the daemon's policy
    cwd: str
    split: int
    settings: Settings
    pid: int
    host: str
    start_unix: float  # the process's start; the sidecar's clock when not said
    start_ns: int
    repeat: bool  # a process that kept training while no sidecar listened
    resume: bool  # continue the split from its state file (a repeat does too)
    info: dict[str, Any]  # INFO_FIELDS and start_unix, for the split's metadata

    @classmethod
    def parse(cls, body: dict[str, Any], now_unix: float) -> Hello:
        """The hello ``body`` received at ``now_unix``; WireError("malformed")."""
        out_dir = body.get("out_dir")
        cwd = body.get("cwd", "/")
        if not isinstance(out_dir, str) or not out_dir or not isinstance(cwd, str):
            raise wire.WireError("malformed", "hello needs 'out_dir' and 'cwd' strings")
        split = _int(body, "split", 0) or 0
        settings = settings_from_hello(body)
        start_ns = _int(body, "start_ns", 0) or 0
        said_unix = body.get("start_unix")
        start_unix = float(said_unix) if isinstance(said_unix, (int, float)) else now_unix
        repeat = bool(body.get("repeat", False))
        info: dict[str, Any] = {k: body.get(k) for k in INFO_FIELDS}
        info["start_unix"] = start_unix
        return cls(
            out_dir,
            cwd,
            split,
            settings,
            _int(body, "pid", 0) or 0,
            str(body.get("host", "")),
            start_unix,
            start_ns,
            repeat,
            bool(body.get("resume", False)) or repeat,
            info,
        )
