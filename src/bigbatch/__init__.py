"""bigbatch: exact gradient caching (GradCache) for contrastive training of embedding
models at batch sizes far beyond accelerator memory.

Public names::

    bb.GradCache, bb.StepResult          # the engine (bigbatch.cache)
    bb.TokenEmbeddings                   # a tower's one-vector-per-token output (bigbatch.embeddings)
    bb.InfoNCE, bb.CorpusInfoNCE, bb.LogitScale, bb.LossOutput   # losses (bigbatch.losses)
    bb.MaxSimInfoNCE                     # late interaction, ColBERT / ColPali (bigbatch.maxsim)
    bb.Matryoshka                        # any loss at several embedding widths (bigbatch.matryoshka)
    bb.RandContext                       # random-state replay (bigbatch.rng)
    bb.functional.cached                 # luyug-style functional API
    bb.distributed                       # init_distributed, gather_with_grad, ...
    bb.errors                            # exception classes
"""

from . import distributed, errors, functional
from .cache import GradCache, StepResult
from .embeddings import TokenEmbeddings
from .errors import (BigBatchError, ConfigError, DataError, InputError, NonFiniteError,
                     RankFailedError, ShapeError)
from .losses import CorpusInfoNCE, InfoNCE, LogitScale, LossOutput
from .matryoshka import Matryoshka
from .maxsim import MaxSimInfoNCE
from .rng import RandContext

__version__ = "0.1.0"

__all__ = [
    "GradCache", "StepResult", "InfoNCE", "CorpusInfoNCE", "LogitScale", "LossOutput", "RandContext",
    "TokenEmbeddings", "MaxSimInfoNCE", "Matryoshka",
    "functional", "distributed", "errors", "BigBatchError", "ConfigError", "InputError", "ShapeError",
    "NonFiniteError", "DataError", "RankFailedError", "__version__",
]
