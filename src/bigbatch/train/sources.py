"""A run's training sources loaded and batched: each ``--train-data`` source's records
(checked, a bad record reported with its file, line, field and the source's name, before
step 1), its :class:`~bigbatch.data.batches.EpochBatches` with its own number of hard
negatives, its prompts, and the :class:`~bigbatch.data.mix.MixedBatches` schedule over
them; and what a checkpoint keeps of the mix and a resume checks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, DataError, shown
from .config import TrainConfig

__all__ = ["load_sources", "ChainedRecords", "mix_state", "data_identity"]


class ChainedRecords(Sequence):
    """Several sources' records read as one sequence (``len`` and indexing), without a copy."""

    def __init__(self, parts: Sequence[Sequence[Any]]) -> None:
        self.parts = list(parts)
        self.starts = []
        n = 0
        for p in self.parts:
            self.starts.append(n)
            n += len(p)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        for start, part in zip(reversed(self.starts), reversed(self.parts)):
            if i >= start:
                return part[i - start]
        raise IndexError(i)  # pragma: no cover


def _load_records(config: TrainConfig, spec: Any, k: int, several: bool) -> Sequence[Any]:
    """One source's records (capped by its ``max_records``), read by index
    (:func:`~bigbatch.data.records.store.open_records`: the main rank validates and indexes
    the source once while the others wait, then every rank opens the index); a problem
    names the source."""
    from ..data.mix import CappedRecords
    from ..data.records.store import open_records
    from ..engine import distributed as D
    from .main_rank import main_first

    try:
        records = main_first(lambda: open_records(spec.path, config.train_split, k,
                                                  config.data_root), D.world_info())
    except DataError as e:
        if not several:
            raise
        raise DataError(f"training source {shown(spec.name)} ({spec.path}): {e}") from e
    return CappedRecords(records, spec.max_records) if spec.max_records else records


def load_sources(config: TrainConfig, rank: int, world_size: int) -> Any:
    """The run's :class:`~bigbatch.data.mix.MixedBatches`: every source loaded (all checked
    before step 1), batched with its own number of hard negatives (default
    ``--num-hard-negatives``), weighted by its ``weight`` or ``--mix-temperature``.

    Raises:
        DataError: a bad record, naming the source (with several), file, line and field.
        ConfigError: a source with fewer records than one global batch, or bad weights.
    """
    from ..data import EpochBatches
    from ..data.mix import MixedBatches, TrainSource, mix_weights

    specs = config.train_sources()
    several = len(specs) > 1
    sources = []
    for spec in specs:
        k = config.num_hard_negatives if spec.num_hard_negatives is None \
            else spec.num_hard_negatives
        if not spec.in_batch_negatives and k == 0:
            raise ConfigError(f"--train-data source {shown(spec.name)}: in_batch_negatives false "
                              f"scores each query against its own documents only, and with "
                              f"no hard negatives that is its positive alone (the loss is 0); "
                              f"give num_hard_negatives >= 1")
        # --refresh-negatives-every mines every record's negatives: none needed of its own
        records = _load_records(config, spec, 0 if config.refresh_negatives_every else k,
                                several)
        batches = EpochBatches(records, config.batch_size, k, config.seed, rank, world_size,
                               scores=config.distill is not None)
        if len(batches) == 0:
            name = f"training source {shown(spec.name)}: " if several else ""
            raise ConfigError(f"{name}{len(records)} training records are fewer than one global "
                              f"batch ({batches.global_batch} = --batch-size x processes)")
        sources.append(TrainSource(spec, records, batches))
    weights = mix_weights(specs, [len(s.records) for s in sources], config.mix_temperature)
    return MixedBatches(sources, weights, config.seed)


def mix_state(mixed: Any) -> dict[str, Any]:
    """What identifies a mix's schedule (names, weights, hard negatives): a resume must
    draw the same sources at the same steps."""
    return {"names": [s.name for s in mixed.sources], "weights": mixed.weights,
            "num_hard_negatives": [s.batches.k for s in mixed.sources]}


def data_identity(mixed: Any) -> tuple[Any, Any]:
    """(training data, record counts) as a checkpoint records them: one source's resolved
    path and count (as before mixes), or each source's ``[name, path]`` and count."""
    if len(mixed.sources) == 1:
        s = mixed.sources[0]
        return os.path.realpath(s.spec.path), len(s.records)
    return ([[s.name, os.path.realpath(s.spec.path)] for s in mixed.sources],
            [len(s.records) for s in mixed.sources])
