"""Several training sources in one run, every global batch drawn from one of them.

Recipes that train on many datasets at once (BGE's ``same_dataset_within_batch``,
contrastors' one shard per batch, sentence-transformers' multi-dataset batch samplers)
draw each batch from a single dataset: negatives from another dataset are trivially easy
and leak format cues. Here:

- :func:`parse_sources` reads ``--train-data`` / ``--eval-data``: one path, a comma list,
  or (YAML) a list whose entries are paths or mappings (:data:`SOURCE_KEYS`).
- :class:`SourceSpec`: one source's settings (name, weight, prompts, hard negatives,
  in-batch negatives, record cap); :func:`mix_weights` the sampling weights (given, or a
  temperature over sizes).
- :class:`MixedBatches`: the schedule. The source of global step ``s`` is drawn from
  ``(seed, s)`` alone, so it is the same on every rank and after a resume; each source
  keeps its own :class:`~bigbatch.data.batches.EpochBatches` position (epoch, batch
  index), and the state a checkpoint keeps is those positions.

A source's records are used through ``len`` and indexing only (a ``Sequence``), so a lazy,
indexed record store serves as well as a list.
"""

from __future__ import annotations

import difflib
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, shown
from .batches import Batch, EpochBatches
from .records.types import TrainRecord

__all__ = ["SourceSpec", "SOURCE_KEYS", "EVAL_KEYS", "parse_sources", "mix_weights",
           "CappedRecords", "TrainSource", "MixedBatches"]

# the keys a --train-data entry may have (spellings users know map to one field)
SOURCE_KEYS = {"path": "path", "name": "name", "weight": "weight",
               "query_instruction": "query_instruction", "doc_instruction": "doc_instruction",
               "document_instruction": "doc_instruction", "query_prefix": "query_prefix",
               "doc_prefix": "doc_prefix", "document_prefix": "doc_prefix",
               "num_hard_negatives": "num_hard_negatives",
               "in_batch_negatives": "in_batch_negatives", "max_records": "max_records"}
# the keys an --eval-data entry may have
EVAL_KEYS = {"path": "path", "name": "name"}


@dataclass
class SourceSpec:
    """One training (or evaluation) source as configured. Unset fields (None) take the
    run's options (``--num-hard-negatives``, ``--query-prefix``, ...)."""

    path: str
    name: str
    weight: float | None = None
    query_instruction: str | None = None
    doc_instruction: str | None = None
    query_prefix: str | None = None
    doc_prefix: str | None = None
    num_hard_negatives: int | None = None
    in_batch_negatives: bool = True
    max_records: int | None = None

    def prompts(self, encoder_type: str) -> dict[str, str | None]:
        """This source's prompts for an encoder of ``encoder_type`` (None: the run's own).
        A text model takes the prefix, else the instruction followed by a space (the
        ms-swift Qwen3-Embedding convention ``"{instruction} {text}"``); a vision-language
        model takes the instruction (its system turn).

        Raises:
            ConfigError: a prefix given for a vision-language model.
        """
        out: dict[str, str | None] = {}
        for side in ("query", "doc"):
            prefix = getattr(self, f"{side}_prefix")
            instruction = getattr(self, f"{side}_instruction")
            if encoder_type == "vision-language":
                if prefix is not None:
                    raise ConfigError(f"--train-data source {shown(self.name)}: {side}_prefix is for "
                                      f"text models; a vision-language model takes "
                                      f"{side}_instruction (its system prompt)")
                out[side] = instruction
            elif prefix is not None:
                out[side] = prefix
            elif instruction is not None:
                out[side] = instruction if not instruction or instruction[-1].isspace() \
                    else instruction + " "
            else:
                out[side] = None
        return out


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _default_name(path: str) -> str:
    p = Path(path)
    return p.name if p.is_dir() or not p.suffix else p.stem


def _check_type(name: str, value: Any, where: str) -> Any:
    """A source field's value, checked against its type."""
    if value is None:
        return None
    if name in ("path", "name", "query_instruction", "doc_instruction", "query_prefix",
                "doc_prefix"):
        required = name in ("path", "name")
        if not isinstance(value, str) or (required and not value.strip()):
            raise ConfigError(f"{where}: {name} must be a{' non-empty' if required else ''} "
                              f"string, got {shown(value)}")
        return value
    if name == "in_batch_negatives":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: in_batch_negatives must be true or false, got {shown(value)}")
        return value
    if name in ("num_hard_negatives", "max_records"):
        if isinstance(value, bool) or not isinstance(value, int) or value < (
                0 if name == "num_hard_negatives" else 1):
            raise ConfigError(f"{where}: {name} must be an integer >= "
                              f"{0 if name == 'num_hard_negatives' else 1}, got {shown(value)}")
        return value
    if name == "weight":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or value != value or value == float("inf"):
            raise ConfigError(f"{where}: weight must be a number > 0, got {shown(value)}")
        return float(value)
    raise AssertionError(name)  # pragma: no cover


def parse_sources(value: Any, option: str = "--train-data", keys: dict[str, str] = SOURCE_KEYS,
                  base: Path | None = None) -> list[SourceSpec]:
    """The sources ``value`` names: a path, a comma-separated list of paths, or a list of
    paths and mappings (``keys``: the keys a mapping may have). Relative paths are read from
    ``base`` (default: as given). Names default to the file's stem (a directory's name).

    Raises:
        ConfigError: naming the entry: an unknown key, a bad value, no path, two sources of
            one name.
    """
    if value is None or value == "":
        return []
    entries = _split(value) if isinstance(value, str) else value
    if not isinstance(entries, list):
        raise ConfigError(f"{option}: expected a path or a list of sources, got {shown(value)}")
    out: list[SourceSpec] = []
    for i, entry in enumerate(entries):
        where = f"{option}[{i}]" if isinstance(value, list) else option
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a path or a mapping with 'path', got {shown(entry)}")
        fields: dict[str, Any] = {}
        for k, v in entry.items():
            key = str(k).replace("-", "_")
            if key not in keys:
                close = difflib.get_close_matches(key, list(keys), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{where}: unknown key {shown(k)}{hint} (a source takes "
                                  f"{', '.join(sorted(keys))})")
            fields[keys[key]] = _check_type(keys[key], v, f"{where}.{key}")
        if not fields.get("path"):
            raise ConfigError(f"{where}: a source needs a 'path'")
        path = Path(os.path.expanduser(fields["path"]))
        if base is not None and not path.is_absolute():
            path = base / path
        fields["path"] = os.path.normpath(path)
        fields.setdefault("name", _default_name(fields["path"]))
        if fields.get("in_batch_negatives") is None:
            fields.pop("in_batch_negatives", None)
        out.append(SourceSpec(**fields))
    names = [s.name for s in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"{option}: two sources are named {shown(dup)}; give each a 'name' (in "
                          f"YAML: - {{path: ..., name: ...}})")
    return out


def mix_weights(specs: Sequence[SourceSpec], sizes: Sequence[int],
                temperature: float = 1.0) -> list[float]:
    """Each source's probability of drawing a step: the given weights, normalised; else, with
    none given, ``size ** (1 / temperature)`` normalised (1: in proportion to size, as if the
    sources were one shuffled file; larger: closer to uniform, up-sampling small sources).

    Raises:
        ConfigError: weights given for some sources but not all, or a temperature <= 0.
    """
    given = [s.weight for s in specs]
    if any(w is not None for w in given):
        missing = [s.name for s in specs if s.weight is None]
        if missing:
            raise ConfigError(f"--train-data: weight given for some sources but not for "
                              f"{missing}; give every source a weight, or none (then "
                              f"--mix-temperature weighs them by size)")
        raw = [float(w) for w in given]
    else:
        if not temperature > 0:
            raise ConfigError(f"--mix-temperature: must be > 0 (got {shown(temperature)})")
        raw = [float(n) ** (1.0 / temperature) for n in sizes]
    total = sum(raw)
    return [w / total for w in raw]


class CappedRecords(Sequence):
    """The first ``limit`` records of a sequence (``max_records``), without a copy."""

    def __init__(self, records: Sequence[TrainRecord], limit: int) -> None:
        self.records = records
        self.n = min(limit, len(records))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.records[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.records[i % self.n]


@dataclass
class TrainSource:
    """A loaded source: its settings, records and batches, and the prompts its steps use
    (None: the run's own)."""

    spec: SourceSpec
    records: Sequence[TrainRecord]
    batches: EpochBatches
    prompts: dict[str, str | None] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name


class MixedBatches:
    """Global batches drawn one source at a time.

    Args:
        sources: the sources, each with its :class:`EpochBatches` (the same global batch).
        weights: each source's probability of drawing a step (:func:`mix_weights`).
        seed: the schedule's seed; step ``s`` draws its source from ``(seed, s)`` only.

    A source whose epoch ends starts its next epoch (a new order) by itself; ``__len__`` is
    the steps of one epoch of every source together.

    Example::

        mixed = MixedBatches([a, b], [0.75, 0.25], seed=42)
        for _, (i, batch) in zip(range(10), mixed.iterate(0, mixed.start_positions())):
            ...  # batch from mixed.sources[i]
    """

    def __init__(self, sources: Sequence[TrainSource], weights: Sequence[float],
                 seed: int) -> None:
        if len(sources) != len(weights) or not sources:
            raise ConfigError("a mix needs one weight per source, and at least one source")
        self.sources = list(sources)
        self.weights = [float(w) for w in weights]
        self.seed = seed
        self.global_batch = self.sources[0].batches.global_batch
        self._cum = []
        acc = 0.0
        for w in self.weights:
            acc += w
            self._cum.append(acc)

    def __len__(self) -> int:
        return sum(len(s.batches) for s in self.sources)

    def source_of(self, step: int) -> int:
        """The index of the source global step ``step`` (0-based) draws from."""
        if len(self.sources) == 1:
            return 0
        u = random.Random(f"bigbatch-mix-{self.seed}-{step}").random() * self._cum[-1]
        return next((i for i, c in enumerate(self._cum) if u < c), len(self._cum) - 1)

    def start_positions(self) -> dict[str, list[int]]:
        """Every source at epoch 0, batch 0."""
        return {s.name: [0, 0] for s in self.sources}

    def iterate(self, step: int, positions: dict[str, list[int]]
                ) -> Iterator[tuple[int, Batch]]:
        """``(source index, batch)`` from global step ``step`` on, forever (the caller stops).
        ``positions``: ``{name: [epoch, next batch index]}`` of every source, as
        :meth:`start_positions` gives or a checkpoint kept (not changed here: after a step,
        its source's position is ``[batch.epoch, batch.index + 1]``)."""
        positions = {k: list(v) for k, v in positions.items()}
        while True:
            i = self.source_of(step)
            src = self.sources[i]
            epoch, index = positions[src.name]
            if index >= len(src.batches):
                epoch, index = epoch + 1, 0
            positions[src.name] = [epoch, index + 1]
            batch = src.batches.batch(epoch, index)
            batch.source = src.name
            yield i, batch
            step += 1
