"""bigbatch's exact GradCache step as a sentence-transformers loss.

:class:`CachedInfoNCELoss` is handed to ``SentenceTransformerTrainer`` as
``CachedMultipleNegativesRankingLoss`` is, with the same columns (``anchor, positive``,
optionally ``negative_1 .. negative_k``) and the same ``mini_batch_size``; the trainer, its
evaluators, callbacks and saving are unchanged. Each training batch runs
:meth:`bigbatch.GradCache.step` (:class:`SentenceTransformerCache`, one tower per column,
all the same model): the gradients equal those of ``MultipleNegativesRankingLoss`` on the
whole batch, with

- a learnable temperature (logit scale, clamped to ``[1, max_scale]`` before each step), or
  sentence-transformers' fixed ``scale=20`` with ``learnable_scale=False``;
- false negatives masked: a document with the same id as a query's positive is not one of
  its negatives; ids come from an integer ``label`` column or, by default, from the text;
- the loss streamed over row blocks (:class:`bigbatch.InfoNCE`), so the ``B x N`` logits
  never exist at once;
- under the trainer's DDP, every rank's queries scored against the documents of all ranks
  (``gather_across_devices=True``, the default), and one gradient all-reduce per step
  (:mod:`bigbatch.integrations.deferred`), however many mini-batches there are.

sentence-transformers is imported by the trainer that calls this loss, never by this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..engine import distributed as D
from ..engine.chunking import Chunk
from ..engine.gradcache import GradCache
from ..errors import ConfigError, InputError, ShapeError
from ..losses import InfoNCE, LossOutput, PartialLoss
from .deferred import evaluation_loss, gradcache_loss

__all__ = ["CachedInfoNCELoss", "ColumnInfoNCE", "SentenceTransformerCache", "column_names",
           "text_ids"]

#: similarity name -> whether the embeddings are L2-normalised before the dot product
SIMILARITIES = {"cosine": True, "dot": False}
#: where document ids come from (see CachedInfoNCELoss)
ID_SOURCES = ("auto", "labels", "text", "none")


def column_names(n: int) -> list[str]:
    """The tower names of ``n`` columns: ``anchor``, ``positive``, ``negative_1`` ..."""
    return ["anchor", "positive"] + [f"negative_{i}" for i in range(1, n - 1)]


def _interleave(columns: Sequence[Tensor]) -> Tensor:
    """Document columns ``[P, N1 .. Nk]`` (each ``(B, D)``) as bigbatch's document layout
    ``[pos_0, neg_0_1 .. neg_0_k, pos_1, ...]``."""
    return torch.stack(list(columns), dim=1).reshape(-1, columns[0].shape[-1])


class ColumnInfoNCE(nn.Module):
    """:class:`bigbatch.InfoNCE` over sentence-transformers' columns.

    Args:
        info_nce: the loss (temperature, symmetric, margin, streaming).

    Inputs (``loss(anchor=a, positive=p, negative_1=n1, ..., doc_ids=None)``):
        anchor, positive, negative_i: ``(B, D)`` embeddings of each column.
        doc_ids: optional ``(B * (1 + k),)`` ids, row ``i``'s ``[positive, negatives]`` in turn.

    Returns:
        :class:`bigbatch.LossOutput`; every query is scored against every document of every
        column (in-batch and hard negatives), as ``MultipleNegativesRankingLoss`` does.
    """

    def __init__(self, info_nce: InfoNCE) -> None:
        super().__init__()
        self.info_nce = info_nce

    @staticmethod
    def _docs(reps: Mapping[str, Tensor]) -> list[str]:
        names = column_names(len(reps) if "anchor" in reps else len(reps) + 1)[1:]
        if sorted(names) != sorted(k for k in reps if k != "anchor"):
            raise InputError(f"expected the columns {column_names(len(names) + 1)}, got "
                             f"{list(reps)}")
        return names

    def forward(self, anchor: Tensor, positive: Tensor, doc_ids: Tensor | None = None,
                **negatives: Tensor) -> LossOutput:
        reps = {"anchor": anchor, "positive": positive, **negatives}
        columns = [reps[n] for n in self._docs(reps)]
        rows = {c.shape[0] for c in columns} | {anchor.shape[0]}
        if len(rows) != 1:
            raise ShapeError(f"every column needs the same number of rows, got "
                             f"{[c.shape[0] for c in [anchor, *columns]]}")
        return self.info_nce(query=anchor, doc=_interleave(columns), doc_ids=doc_ids)

    def cross_device_forward(self, gathered: D.Gathered,
                             doc_ids: Tensor | None = None) -> PartialLoss:
        """This rank's part of the global-batch loss: the gathered columns interleaved rank by
        rank, then :meth:`bigbatch.InfoNCE.cross_device_forward`."""
        names = self._docs(gathered.reps)
        counts = gathered.counts["anchor"]
        if any(gathered.counts[n] != counts for n in names):  # the same on every rank
            raise ShapeError(f"every column needs the same number of rows on each rank, got "
                             f"{ {n: gathered.counts[n] for n in ['anchor', *names]} }")
        docs = _interleave([gathered.reps[n] for n in names])
        merged = D.Gathered({"query": gathered.reps["anchor"], "doc": docs},
                            {"query": list(counts), "doc": [c * len(names) for c in counts]},
                            gathered.rank, gathered.world_size, gathered.group)
        return self.info_nce.cross_device_forward(merged, doc_ids=doc_ids)

    def clamp_(self) -> "ColumnInfoNCE":
        """Clamp the logit scale into its bounds (after an optimizer step)."""
        self.info_nce.clamp_()
        return self


class SentenceTransformerCache(GradCache):
    """:class:`bigbatch.GradCache` whose towers are a ``SentenceTransformer`` (or the DDP
    wrapper around it): a chunk is a features dict, its embedding the model's
    ``"sentence_embedding"``, L2-normalised when ``normalize``.

    Args:
        normalize: L2-normalise the embeddings (cosine similarity).
        other arguments: as :class:`bigbatch.GradCache`.
    """

    def __init__(self, towers: Mapping[str, nn.Module], loss_fn: Any, chunk_size: int, *,
                 normalize: bool = True, **options: Any) -> None:
        super().__init__(towers, loss_fn, chunk_size, **options)
        self.normalize = normalize

    def embed(self, name: str, chunk: Chunk) -> Tensor:
        model = D.unwrap_ddp(self.towers[name])
        # a copy: the model's modules write their outputs into the dict they are given
        out = model(dict(chunk))["sentence_embedding"]
        return nn.functional.normalize(out, p=2, dim=-1) if self.normalize else out


def text_ids(features: Mapping[str, Tensor]) -> Tensor:
    """One int64 id per row of a tokenized column, equal for rows with the same tokens
    (whatever their padding, left or right): a 64-bit hash of the token ids in order."""
    ids, mask = features["input_ids"], features.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else (mask != 0).to(ids.dtype)
    order = (mask.cumsum(1) - 1).clamp_min(0)  # each real token's place in its row
    gen = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(1, 2 ** 62, (ids.shape[1],), generator=gen).to(ids.device)
    lengths = mask.sum(1)
    return ((ids.long() + 1) * mask * weights[order]).sum(1) * 3 + lengths  # wraps mod 2**64


class CachedInfoNCELoss(nn.Module):
    """A sentence-transformers loss that runs bigbatch's exact GradCache step.

    Use it where you would use ``CachedMultipleNegativesRankingLoss``: the same columns
    (``anchor, positive`` or ``anchor, positive, negative_1, ..., negative_k``) and
    ``mini_batch_size``. With ``learnable_scale=False`` and no duplicate texts in a batch
    its gradients are those of ``MultipleNegativesRankingLoss(model, scale)`` on the whole
    batch (with the same dropout masks).

    Args:
        model: the ``SentenceTransformer`` (the trainer puts its DDP wrapper in its place).
        scale: the initial logit scale ``1 / temperature`` (sentence-transformers' 20).
        learnable_scale: learn the scale with the model (it joins the trainer's optimizer,
            is clamped to ``[1, max_scale]`` before each step); False: fixed at ``scale``.
        max_scale: the learnable scale's upper bound (CLIP's 100).
        mini_batch_size: rows per chunk of each column in the two passes.
        similarity: ``"cosine"`` (embeddings L2-normalised) or ``"dot"``.
        symmetric: also the document-to-query direction, averaged with the other
            (sentence-transformers' ``directions=("query_to_doc", "doc_to_query")`` with
            ``partition_mode="per_direction"``).
        ids: where document ids come from, to mask a document with the same id as a
            query's positive out of that query's negatives. ``"labels"``: an integer
            ``label`` column holding, for each row, the ids of its positive and negatives
            (``[pos_id, neg_1_id, ...]``, or one id when there are no negatives);
            ``"text"``: the tokens (the same text is the same document); ``"auto"``
            (default): the labels when the dataset has an integer ``label`` column, else the
            text (none for columns without tokens, such as images); ``"none"``: no masking,
            exactly ``MultipleNegativesRankingLoss``.
        gather_across_devices: under DDP, score every rank's queries against the documents
            of all ranks (the global batch); False: each rank's batch alone.
        false_negative_margin: also mask a negative more similar than the positive plus
            this margin (ms-swift's rule uses 0.1).
        engine_options: further :class:`bigbatch.GradCache` options (``sort_by_length``,
            ``autocast_dtype``, ``check_finite``, ...).

    Inputs:
        sentence_features: the trainer's tokenized columns, anchor first.
        labels: the ``label`` column, or None.

    Returns:
        the full-batch loss (the global batch's under DDP with ``gather_across_devices``);
        its backward applies the step's gradients, scaled as the trainer asks.

    Example::

        from sentence_transformers import SentenceTransformerTrainer
        from bigbatch.integrations.sentence_transformers import CachedInfoNCELoss

        loss = CachedInfoNCELoss(model, mini_batch_size=32)
        SentenceTransformerTrainer(model=model, train_dataset=ds, loss=loss).train()

    References:
        Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
        Setup"; Henderson et al. 2017, "Efficient Natural Language Response Suggestion for
        Smart Reply" (the multiple-negatives ranking loss).
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, learnable_scale: bool = True,
                 max_scale: float = 100.0, mini_batch_size: int = 32, similarity: str = "cosine",
                 symmetric: bool = False, ids: str = "auto", gather_across_devices: bool = True,
                 false_negative_margin: float | None = None,
                 engine_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(mini_batch_size, int) or mini_batch_size <= 0:
            raise ConfigError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        if similarity not in SIMILARITIES:
            raise ConfigError(f"similarity must be one of {sorted(SIMILARITIES)}, got "
                              f"{similarity!r}")
        if ids not in ID_SOURCES:
            raise ConfigError(f"ids must be one of {ID_SOURCES}, got {ids!r}")
        if not scale > 0:
            raise ConfigError(f"scale must be > 0, got {scale!r}")
        if learnable_scale and not 1.0 <= scale <= max_scale:
            raise ConfigError(f"a learnable scale starts in [1, max_scale] = [1, {max_scale:g}] "
                              f"(it is clamped there), got {scale!r}; raise max_scale or pass "
                              f"learnable_scale=False")
        self.model = model
        self.loss = ColumnInfoNCE(InfoNCE(temperature=1.0 / scale,
                                          learnable_temperature=learnable_scale,
                                          symmetric=symmetric, max_scale=max_scale,
                                          false_negative_margin=false_negative_margin))
        self.mini_batch_size = mini_batch_size
        self.similarity = similarity
        self.ids = ids
        self.gather_across_devices = gather_across_devices
        self.engine_options = dict(engine_options or {})
        self.engine_options.setdefault("cross_device", gather_across_devices)

    @property
    def scale(self) -> float:
        """The current logit scale ``1 / temperature``."""
        return 1.0 / self.loss.info_nce.temperature

    @property
    def temperature(self) -> float:
        return self.loss.info_nce.temperature

    def engine(self, columns: int) -> SentenceTransformerCache:
        """The engine for a batch of ``columns`` columns, over the current ``self.model``."""
        names = column_names(columns)
        return SentenceTransformerCache({n: self.model for n in names}, self.loss,
                                        self.mini_batch_size,
                                        normalize=SIMILARITIES[self.similarity],
                                        **self.engine_options)

    def doc_ids(self, features: Sequence[Mapping[str, Tensor]],
                labels: Tensor | None) -> Tensor | None:
        """Each document's id in bigbatch's layout (row by row: positive, negatives), or None.

        Raises:
            InputError: ``ids="labels"`` without an integer ``label`` column, or labels of a
                shape other than ``(rows,)`` or ``(rows, 1 + negatives)``."""
        source = self.ids
        is_int = (isinstance(labels, Tensor) and not labels.is_floating_point()
                  and not labels.is_complex() and labels.dtype != torch.bool)
        docs = features[1:]
        if source == "auto":  # labels, else the text, else (no tokens: images) no masking
            tokenized = all("input_ids" in f for f in docs)
            source = "labels" if is_int else "text" if tokenized else "none"
        if source == "none":
            return None
        rows = features[0]["input_ids"].shape[0] if "input_ids" in features[0] else None
        if source == "labels":
            if not is_int:
                raise InputError("ids='labels' needs an integer 'label' column with each row's "
                                 "[positive id, negative ids...]; the dataset has "
                                 + ("none" if labels is None else f"one of dtype {labels.dtype}"))
            shape = (rows, len(docs))
            if tuple(labels.shape) not in (shape, (rows,) if len(docs) == 1 else shape):
                raise InputError(f"the 'label' column holds document ids of shape "
                                 f"{tuple(labels.shape)}; expected {shape}: per row the ids of "
                                 f"its positive and its {len(docs) - 1} negative(s)")
            return labels.reshape(-1).long()
        if any("input_ids" not in f for f in docs):
            raise InputError("ids='text' needs tokenized text columns (input_ids); pass "
                             "ids='none' or an integer 'label' column of document ids")
        return _interleave([text_ids(f).unsqueeze(1) for f in docs]).reshape(-1)

    def forward(self, sentence_features: Iterable[Mapping[str, Tensor]],
                labels: Tensor | None = None) -> Tensor:
        features = list(sentence_features)
        if len(features) < 2:
            raise InputError(f"CachedInfoNCELoss needs at least 2 columns (anchor, positive), "
                             f"got {len(features)}")
        inputs: dict[str, Any] = dict(zip(column_names(len(features)), features))
        ids = self.doc_ids(features, labels)
        if ids is not None:
            inputs["doc_ids"] = ids
        cache = self.engine(len(features))
        if not torch.is_grad_enabled():
            return evaluation_loss(cache, **inputs)
        self.loss.clamp_()  # after the previous optimizer step, before this use
        return gradcache_loss(cache, **inputs)

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's settings, as sentence-transformers writes them in the model card."""
        return {"scale": self.scale, "learnable_scale": isinstance(
                    self.loss.info_nce.logit_scale.log_scale, nn.Parameter),
                "mini_batch_size": self.mini_batch_size, "similarity": self.similarity,
                "symmetric": self.loss.info_nce.symmetric, "ids": self.ids,
                "gather_across_devices": self.gather_across_devices}

    @property
    def citation(self) -> str:
        return """
@inproceedings{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    booktitle={Proceedings of the 6th Workshop on Representation Learning for NLP},
    year={2021}
}
"""
