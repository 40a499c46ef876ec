"""The frozen guide model of guided false-negative filtering (``--guide-model``, GISTEmbed).

The guide embeds each step's local batch once, in eval mode and without gradients, and the
loss masks the negatives it scores above their query's positive
(:mod:`bigbatch.losses.guided`). It is never replayed, never trained and never saved with the run;
its width may differ from the trained model's. ``--guide-model self`` is the trained
model's own starting weights (``--model``, without the adapter or any update), loaded again,
so a resumed run has the same guide as the run it continues.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .build import build_encoder
from .config import TrainConfig

__all__ = ["Guide"]


class Guide:
    """The guide tower of a run.

    Args:
        config: the run's configuration (``guide_model``: ``"self"`` or a model folder).
        records: the training records (``self`` builds the encoder as the run does).
        device: where the guide runs.
        batch_size: rows the guide embeds at once.
    """

    def __init__(self, config: TrainConfig, records: list, device: torch.device,
                 batch_size: int) -> None:
        from ..encoders.loading import load_encoder

        with torch.random.fork_rng(devices=[]):  # the run's random draws stay as without a guide
            if config.guide_model == "self":
                enc = build_encoder(config, records, lora_r=0)
            else:
                # the run's truncation; prefixes and pooling are the guide folder's own
                enc = load_encoder(config.guide_model, max_length=config.max_length)
        for p in enc.parameters():
            p.requires_grad_(False)
        self.encoder = enc.to(device).eval()
        self.device = device
        self.batch_size = batch_size

    @torch.no_grad()
    def embed(self, queries: list[Any], docs: list[Any]) -> dict[str, Tensor]:
        """The guide's embeddings of a batch, as the loss takes them:
        ``{"guide_query": (B, G), "guide_doc": (N, G)}`` on the guide's device."""
        q = self.encoder.encode(queries, "query", batch_size=self.batch_size, device=self.device)
        d = self.encoder.encode(docs, "doc", batch_size=self.batch_size, device=self.device)
        return {"guide_query": q.to(self.device), "guide_doc": d.to(self.device)}
