"""Losses: one family per module, each seeing the whole batch's embeddings.

- :mod:`~bigbatch.losses.base`: the temperature (:class:`LogitScale`, :class:`TemperatureLoss`)
  and what a loss returns (:class:`LossOutput`, :class:`PartialLoss`);
- :mod:`~bigbatch.losses.infonce`: :class:`InfoNCE` with in-batch and hard negatives;
- :mod:`~bigbatch.losses.corpus`: :class:`CorpusInfoNCE`, negatives from a fixed corpus;
- :mod:`~bigbatch.losses.blockwise`: the streamed cross-entropy kernel they share;
- :mod:`~bigbatch.losses.maxsim`: :class:`MaxSimInfoNCE`, late interaction (ColBERT, ColPali);
- :mod:`~bigbatch.losses.matryoshka`: :class:`Matryoshka`, any loss at several widths;
- :mod:`~bigbatch.losses.guided`: a guide model's false-negative filter (GISTEmbed);
- :mod:`~bigbatch.losses.distill`: a teacher's scores (KL, MarginMSE);
- :mod:`~bigbatch.losses.queue`: earlier steps' documents as extra negatives
  (:class:`NegativeQueue`, :class:`QueuedDocs`);
- :mod:`~bigbatch.losses.layout`: the layout rules, in plain Python (the JAX losses share it).

The losses import the engine's types only; the engine imports no loss. The names here are
imported when first used, so importing :mod:`~bigbatch.losses.layout` alone imports no torch.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__all__ = ["LogitScale", "LossOutput", "PartialLoss", "TemperatureLoss", "ids_tensor",
           "CorpusInfoNCE", "InfoNCE", "EXTRA_NEGATIVES", "MAX_BLOCK_LOGITS", "STATS",
           "extra_negatives_of", "hard_negative_count", "initial_log_scale", "rows_per_block",
           "Matryoshka", "MaxSimInfoNCE", "NegativeQueue", "QueuedDocs"]

# resolved when first used: the torch-free layout rules (what bigbatch.jax imports) do not
# import torch through this package's face
__getattr__, __dir__ = lazy_names(__name__, {
    **dict.fromkeys(("LogitScale", "LossOutput", "PartialLoss", "TemperatureLoss", "ids_tensor"),
                    ".base"),
    "CorpusInfoNCE": ".corpus", "InfoNCE": ".infonce", "Matryoshka": ".matryoshka",
    "MaxSimInfoNCE": ".maxsim", "NegativeQueue": ".queue", "QueuedDocs": ".queue",
    **dict.fromkeys(("EXTRA_NEGATIVES", "MAX_BLOCK_LOGITS", "STATS", "extra_negatives_of",
                     "hard_negative_count", "initial_log_scale", "rows_per_block"), ".layout")})

if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from .base import LogitScale, LossOutput, PartialLoss, TemperatureLoss, ids_tensor
    from .corpus import CorpusInfoNCE
    from .infonce import InfoNCE
    from .layout import (
        EXTRA_NEGATIVES,
        MAX_BLOCK_LOGITS,
        STATS,
        extra_negatives_of,
        hard_negative_count,
        initial_log_scale,
        rows_per_block,
    )
    from .matryoshka import Matryoshka
    from .maxsim import MaxSimInfoNCE
    from .queue import NegativeQueue, QueuedDocs
