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
- :mod:`~bigbatch.losses.layout`: the layout rules, in plain Python (the JAX losses share it).

The losses import the engine's types only; the engine imports no loss.
"""

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

__all__ = ["LogitScale", "LossOutput", "PartialLoss", "TemperatureLoss", "ids_tensor",
           "CorpusInfoNCE", "InfoNCE", "EXTRA_NEGATIVES", "MAX_BLOCK_LOGITS", "STATS",
           "extra_negatives_of", "hard_negative_count", "initial_log_scale", "rows_per_block",
           "Matryoshka", "MaxSimInfoNCE"]
