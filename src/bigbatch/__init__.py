"""bigbatch: exact gradient caching (GradCache) for contrastive training of embedding
models at batch sizes far beyond accelerator memory.

Public names::

    bb.GradCache, bb.StepResult          # the engine (bigbatch.cache)
    bb.InfoNCE, bb.CorpusInfoNCE, bb.LogitScale, bb.LossOutput   # losses (bigbatch.losses)
    bb.RandContext                       # random-state replay (bigbatch.rng)
    bb.functional.cached                 # luyug-style functional API
    bb.distributed                       # init_distributed, gather_with_grad, ...
    bb.errors                            # exception classes
"""

from . import distributed, errors, functional
from .cache import GradCache, StepResult
from .errors import (BigBatchError, ConfigError, DataError, InputError, NonFiniteError,
                     RankFailedError, ShapeError)
from .losses import CorpusInfoNCE, InfoNCE, LogitScale, LossOutput
from .rng import RandContext

__version__ = "0.1.0"

__all__ = [
    "GradCache", "StepResult", "InfoNCE", "CorpusInfoNCE", "LogitScale", "LossOutput", "RandContext",
    "functional", "distributed", "errors", "BigBatchError", "ConfigError", "InputError", "ShapeError",
    "NonFiniteError", "DataError", "RankFailedError", "__version__",
]
