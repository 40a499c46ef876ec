"""Which run wrote what: each run has an id, recorded in ``run.json`` in its output folder
and in each checkpoint it writes (``checkpoint-N/run.json``, ``best/run.json``), so that
checkpoints are ordered and rotated by the run that wrote them, not by step number alone.

A folder or checkpoint written before run ids existed has no ``run.json``; its id reads as
None, and such a checkpoint counts as the folder's own (see :func:`belongs_to`).
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from .durable import write_text_atomic

__all__ = ["RUN_FILE", "new_run_id", "run_id_of", "write_run_file", "belongs_to"]

RUN_FILE = "run.json"


def new_run_id() -> str:
    """A new run's id: its start time and a random suffix (``20260101-120000-3fa2c1``)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def run_id_of(folder: str | Path) -> str | None:
    """The run id recorded in ``folder/run.json`` (an output folder or a checkpoint), None
    when there is none or it cannot be read."""
    try:
        value = json.loads((Path(folder) / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def write_run_file(folder: str | Path, run_id: str, **extra: Any) -> Path:
    """Write ``folder/run.json`` naming ``run_id`` (with ``extra`` fields), replacing it in one
    rename and flushing its contents; the caller flushes the folder's entries."""
    path = Path(folder) / RUN_FILE
    write_text_atomic(path, json.dumps({"run_id": run_id, **extra}, indent=2) + "\n")
    return path


def belongs_to(checkpoint: str | Path, run_id: str | None) -> bool:
    """Whether a checkpoint is run ``run_id``'s: it names that run, or it names none (written
    before run ids existed, or ``run_id`` is None: a folder without ``run.json``)."""
    own = run_id_of(checkpoint)
    return own is None or run_id is None or own == run_id
