"""Folders of shards as one source: JSONL or Parquet files side by side, as the Hugging Face
hub lays out datasets (``train-00000-of-00004.parquet``, ``data/part-0001.jsonl``).

A shard folder is a folder that is neither a ``datasets`` folder (``save_to_disk``) nor a
BEIR directory (no ``corpus.jsonl``) and holds ``.jsonl`` or ``.parquet`` files, directly or
in a ``data/`` subfolder. Its shards are read in name order, every shard in the one format
of the first (each keeps its own file name and line numbers in messages). Where every name
follows the hub's ``<split>-NNNNN-of-NNNNN`` pattern, only the shards of ``--split`` are
read.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import DataError, shown
from .tables import is_hf_dataset

__all__ = ["SHARD_SUFFIXES", "is_shard_folder", "shard_files"]

SHARD_SUFFIXES = (".jsonl", ".parquet")
_HUB_NAME = re.compile(r"^(?P<split>.+?)-\d+-of-\d+\.")


def _shards_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir()
                  if p.suffix.lower() in SHARD_SUFFIXES and not p.name.startswith("."))


def _folder_of_shards(path: Path) -> Path | None:
    """The folder holding ``path``'s shards (itself or its ``data/``), or None."""
    if not path.is_dir() or is_hf_dataset(path) or (path / "corpus.jsonl").exists():
        return None
    for folder in (path, path / "data"):
        if folder.is_dir() and _shards_in(folder):
            return folder
    return None


def is_shard_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder of JSONL or Parquet shards (see the module)."""
    return _folder_of_shards(Path(path)) is not None


def shard_files(path: str | Path, split: str = "train") -> list[Path]:
    """The shards of a shard folder, in name order (of ``split`` where the names are the
    hub's ``<split>-NNNNN-of-NNNNN``).

    Raises:
        DataError: not a shard folder, shards of both suffixes, or no shard of ``split``.
    """
    path = Path(path)
    folder = _folder_of_shards(path)
    if folder is None:
        raise DataError("not a folder of .jsonl or .parquet shards", path=str(path))
    files = _shards_in(folder)
    suffixes = sorted({p.suffix.lower() for p in files})
    if len(suffixes) > 1:
        raise DataError(f"a shard folder holds one kind of file; this one has "
                        f"{' and '.join(suffixes)} files: move one kind elsewhere",
                        path=str(folder))
    splits = [_HUB_NAME.match(p.name) for p in files]
    if all(splits):
        names = sorted({m.group("split") for m in splits if m})
        files = [p for p, m in zip(files, splits) if m and m.group("split") == split]
        if not files:
            raise DataError(f"no shard of split {shown(split)} (shards of: {', '.join(names)}); "
                            f"pass --split", path=str(folder))
    return files
