"""The versioned state file a checkpoint leaves beside a split's files, read on resume;
the same document travels through the training process with ``run.state_dict()``.

Schema history: 1 (first release); 2 adds, per rank, ``saved_unix``, ``downtime_s`` and
``redone_s`` (the wall-time account of resumes) and, per split, ``received`` (records
taken per run id, so a new sidecar knows what its predecessor had) and ``gaps`` (spans
when no sidecar saved the run's records). A schema-1 document is upgraded on reading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = 2
FILE_NAME = "sidecar-state.json"


class StateError(Exception):
    """A state that cannot be used; the message says why and what to do."""


def state_path(split_dir: Path) -> Path:
    """Where the state of the split whose folder is ``split_dir`` lives."""
    return split_dir / FILE_NAME


def document(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` stamped with the current schema (what the file and ``state_dict`` hold)."""
    return {"schema": SCHEMA, **state}


def dumps(state: dict[str, Any]) -> str:
    """The text of a state file for ``state`` (stamped with the current schema).

    One line: ``indent`` would switch ``json`` to its pure-Python encoder, ~10× slower on
    the 10⁵–10⁶ stored rows of a large cap.
    """
    return json.dumps(document(state), separators=(",", ":")) + "\n"


def upgrade(state: Any, where: str = "state") -> dict[str, Any]:
    """``state`` (a decoded document) in the current schema.

    Older schemas are upgraded (schema 1: the fields schema 2 added get their neutral
    values: no downtime, no redone work, nothing received, no gaps). Raises StateError for
    a document that is not an object, has no schema, a newer one (upgrade the sidecar) or
    lacks a field of its schema; ``where`` names the document in the message.
    """
    if not isinstance(state, dict):
        raise StateError(f"{where} is not a JSON object")
    schema = state.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise StateError(f"{where} has no valid schema number ({schema!r}); it was not "
                         "written by a sidecar")
    if schema > SCHEMA:
        raise StateError(f"{where} has schema {schema}, newer than this sidecar's {SCHEMA}: "
                         "upgrade the sidecar to resume from it")
    for key in ("split", "settings", "gpus", "batch_sizes", "dropped", "lost", "rejected",
                "ranks"):
        if key not in state:
            raise StateError(f"{where} (schema {schema}) lacks the field {key!r}")
    state = dict(state)
    if schema == 1:
        state.setdefault("received", {})
        state.setdefault("gaps", [])
        ranks = state["ranks"] if isinstance(state["ranks"], dict) else {}
        state["ranks"] = {
            rank: {"downtime_s": 0.0, "redone_s": 0.0,
                   "saved_unix": _last_unix(saved), **saved}
            for rank, saved in ranks.items() if isinstance(saved, dict)
        }
    state["schema"] = SCHEMA
    return state


def _last_unix(rank_state: dict[str, Any]) -> float:
    """When a schema-1 rank state was saved: the end of its last session."""
    sessions = rank_state.get("sessions") or []
    if not sessions or not isinstance(sessions[-1], dict):
        return float(rank_state.get("run_start_unix", 0.0))
    last = sessions[-1]
    end_ns = last.get("end_ns") if last.get("end_ns") is not None else last.get("last_ns", 0)
    return float(last.get("start_unix", 0.0)) + (end_ns - last.get("start_ns", 0)) / 1e9


def load(path: Path) -> dict[str, Any]:
    """Read a state file and return it in the current schema (see ``upgrade``).

    Raises StateError when it is missing, not JSON, or of a schema this version can't read.
    """
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StateError(f"no saved state at {path}: resume needs a checkpoint first") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"state file {path} is unreadable: {exc}") from None
    return upgrade(state, f"state file {path}")
