"""The versioned state file a checkpoint leaves beside a split's files, read on resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = 1
FILE_NAME = "sidecar-state.json"


class StateError(Exception):
    """A state file that cannot be used; the message says why and what to do."""


def state_path(split_dir: Path) -> Path:
    """Where the state of the split whose folder is ``split_dir`` lives."""
    return split_dir / FILE_NAME


def dumps(state: dict[str, Any]) -> str:
    """The text of a state file for ``state`` (stamped with the current schema)."""
    return json.dumps({"schema": SCHEMA, **state}, indent=1)


def load(path: Path) -> dict[str, Any]:
    """Read and check a state file.

    Raises StateError when it is missing, not JSON, or of a schema this version can't read
    (a newer one: upgrade the sidecar; an older one: none exists yet, so none is upgraded).
    """
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StateError(f"no saved state at {path}: resume needs a checkpoint first") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"state file {path} is unreadable: {exc}") from None
    schema = state.get("schema") if isinstance(state, dict) else None
    if schema != SCHEMA:
        raise StateError(f"state file {path} has schema {schema!r}; this sidecar reads "
                         f"schema {SCHEMA} only")
    return state
