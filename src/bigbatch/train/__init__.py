"""The training pipeline: configuration, building a run's parts, the loop, resume checks,
schedules, checkpoints, corpus negatives and logging.

The names are imported when first used: ``bigbatch.train.config`` (the options, for
``bigbatch train --help``) does not import torch; ``train`` does."""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__all__ = ["TrainConfig", "load_config", "train", "StepCallback"]

__getattr__, __dir__ = lazy_names(__name__, {
    "TrainConfig": ".config", "load_config": ".config", "train": ".loop",
    "StepCallback": ".loop"})

if TYPE_CHECKING:  # for type checkers, editors and the docs: the same names, imported eagerly
    from .config import TrainConfig, load_config
    from .loop import StepCallback, train
