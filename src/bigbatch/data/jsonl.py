"""Reading JSONL files line by line with the line number, for every reader in bigbatch.data."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["iter_jsonl"]


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """Yield ``(line number, object, None)`` for each non-empty line holding a JSON object, and
    ``(line number, None, problem)`` for one that does not; the caller raises or collects."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield n, None, f"malformed JSON ({e.msg})"
                continue
            if not isinstance(rec, dict):
                yield n, None, "expected a JSON object"
                continue
            yield n, rec, None
