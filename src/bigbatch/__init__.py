"""bigbatch: exact gradient caching (GradCache) for contrastive training of embedding
models at batch sizes far beyond accelerator memory.

Public names::

    bb.GradCache, bb.StepResult          # the engine (bigbatch.engine.gradcache)
    bb.TokenEmbeddings                   # a tower's one-vector-per-token output (bigbatch.engine.embeddings)
    bb.InfoNCE, bb.CorpusInfoNCE, bb.LogitScale, bb.LossOutput   # losses (bigbatch.losses)
    bb.MaxSimInfoNCE                     # late interaction, ColBERT / ColPali (bigbatch.losses.maxsim)
    bb.Matryoshka                        # any loss at several embedding widths (bigbatch.losses.matryoshka)
    bb.RandContext                       # random-state replay (bigbatch.engine.rng)
    bb.functional.cached                 # luyug-style functional API (bigbatch.engine.functional)
    bb.distributed                       # init_distributed, gather_with_grad, ...
                                         # (bigbatch.engine.distributed)
    bb.errors                            # exception classes

The names are resolved when first used, so ``import bigbatch`` (and ``bigbatch --help``)
does not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (
    BigBatchError,
    ConfigError,
    DataError,
    InputError,
    NonFiniteError,
    RankFailedError,
    ShapeError,
)

__version__ = "0.1.0"

# public name -> (module, attribute; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "GradCache": (".engine.gradcache", "GradCache"),
    "StepResult": (".engine.gradcache", "StepResult"),
    "TokenEmbeddings": (".engine.embeddings", "TokenEmbeddings"),
    "RandContext": (".engine.rng", "RandContext"),
    "functional": (".engine.functional", None),
    "distributed": (".engine.distributed", None),
    "InfoNCE": (".losses", "InfoNCE"),
    "CorpusInfoNCE": (".losses", "CorpusInfoNCE"),
    "LogitScale": (".losses", "LogitScale"),
    "LossOutput": (".losses", "LossOutput"),
    "MaxSimInfoNCE": (".losses", "MaxSimInfoNCE"),
    "Matryoshka": (".losses", "Matryoshka"),
}

__all__ = [
    "GradCache", "StepResult", "InfoNCE", "CorpusInfoNCE", "LogitScale", "LossOutput", "RandContext",
    "TokenEmbeddings", "MaxSimInfoNCE", "Matryoshka",
    "functional", "distributed", "errors", "BigBatchError", "ConfigError", "InputError", "ShapeError",
    "NonFiniteError", "DataError", "RankFailedError", "__version__",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
            return importlib.import_module(f".{name}", __name__)  # a room: bb.losses, ...
        raise AttributeError(f"module 'bigbatch' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module, __name__)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .engine import distributed, functional
    from .engine.embeddings import TokenEmbeddings
    from .engine.gradcache import GradCache, StepResult
    from .engine.rng import RandContext
    from .losses import CorpusInfoNCE, InfoNCE, LogitScale, LossOutput, Matryoshka, MaxSimInfoNCE
