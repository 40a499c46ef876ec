"""bigbatch's exact GradCache step inside ``transformers.Trainer``.

:class:`GradCacheTrainer` is a ``Trainer`` whose loss is a bigbatch step: each batch (a
dict ``{tower: tokenized inputs, loss extras}``, from your ``data_collator``) runs
:meth:`bigbatch.GradCache.step` with the model as every tower, through
:func:`bigbatch.integrations.deferred.gradcache_loss`. The Trainer's own backward then
applies gradient accumulation and loss scaling, and under DDP the gradients are summed over
the ranks once per optimizer step; the global batch's embeddings are the negatives of every
query. Everything else (optimizer, scheduler, clipping, callbacks, logging, checkpoints,
evaluation) is the Trainer's.

This module imports transformers (the class subclasses ``Trainer``); ``import bigbatch``
does not import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from ..encoders.base import EncoderBase
from ..engine.gradcache import GradCache
from ..errors import ConfigError
from .deferred import evaluation_loss, gradcache_loss

__all__ = ["GradCacheTrainer"]


class _ZeroLossGrads(TrainerCallback):
    """The Trainer zeroes the model's gradients after each optimizer step; the loss's own
    parameters (a learnable temperature) are zeroed here."""

    def __init__(self, loss_fn: nn.Module) -> None:
        self.loss_fn = loss_fn

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.loss_fn.zero_grad(set_to_none=True)


class GradCacheTrainer(Trainer):
    """A ``transformers.Trainer`` whose training step is one exact bigbatch GradCache step.

    Args:
        loss_fn: the contrastive loss, e.g. ``bb.InfoNCE(temperature=0.05)``; its parameters
            (a learnable temperature) join the Trainer's optimizer (without weight decay) and
            its ``clamp_()`` runs before each step.
        chunk_size: rows per chunk (one int, or ``{tower: int}``).
        towers: the tower names, each the Trainer's model (default ``("query", "doc")``).
        engine_options: further :class:`bigbatch.GradCache` options.
        args, kwargs: the Trainer's. ``model`` is any module that maps a tower's tokenized
            chunk (``model(**chunk)``) to ``(rows, dim)`` embeddings, such as
            :class:`bigbatch.encoders.TextEncoder`; ``remove_unused_columns`` is set to False
            (the batches are dicts of towers, not the model's keyword arguments).

    Inputs (each batch, from ``data_collator``):
        ``{"query": tokenized queries, "doc": tokenized documents, "doc_ids": ...}``: one
        entry per tower and the loss's extras, as :meth:`bigbatch.GradCache.step` takes them.

    Example::

        trainer = GradCacheTrainer(model=encoder, args=TrainingArguments("out"),
                                   train_dataset=pairs, data_collator=collate,
                                   loss_fn=bb.InfoNCE(temperature=0.05), chunk_size=32)
        trainer.train()

    Raises:
        ConfigError: no towers, or options :class:`bigbatch.GradCache` refuses.

    References:
        Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
        Setup".
    """

    def __init__(self, *args: Any, loss_fn: Any, chunk_size: int | Mapping[str, int],
                 towers: Sequence[str] = ("query", "doc"),
                 engine_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not towers:
            raise ConfigError("towers must name at least one tower, e.g. ('query', 'doc')")
        self.args.remove_unused_columns = False
        self.tower_names = list(towers)
        self.chunk_size = chunk_size
        self.engine_options = dict(engine_options or {})
        if isinstance(loss_fn, nn.Module):
            loss_fn = loss_fn.to(self.args.device)
            self.add_callback(_ZeroLossGrads(loss_fn))
        self.loss_fn = loss_fn
        self._engines: dict[int, GradCache] = {}
        self.engine(self.model)  # bad options fail here, not at the first step

    def engine(self, model: nn.Module) -> GradCache:
        """The engine over ``model`` (the Trainer's model, or its DDP wrapper)."""
        if id(model) not in self._engines:
            self._engines[id(model)] = GradCache({n: model for n in self.tower_names},
                                                 self.loss_fn, self.chunk_size,
                                                 **self.engine_options)
        return self._engines[id(model)]

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if isinstance(self.loss_fn, nn.Module):
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            extra = [p for p in self.loss_fn.parameters() if p.requires_grad and id(p) not in held]
            if extra:
                optimizer.add_param_group({"params": extra, "weight_decay": 0.0})
        return optimizer

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        cache = self.engine(model)
        if torch.is_grad_enabled():
            clamp = getattr(self.loss_fn, "clamp_", None)
            if clamp is not None:
                clamp()  # after the previous optimizer step, before this use
            loss = gradcache_loss(cache, **inputs)
        else:
            loss = evaluation_loss(cache, **inputs)
        return (loss, {}) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, None, None]:
        """Evaluation: the loss of the batch (embedded chunk by chunk), no predictions."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            return self.compute_loss(model, inputs), None, None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """A bigbatch encoder saves itself (the folder transformers, peft,
        sentence-transformers and ``bigbatch.encoders.load_encoder`` load); any other model
        as the Trainer saves it."""
        if isinstance(self.model, EncoderBase):
            if self.args.should_save:
                self.model.save(output_dir if output_dir is not None else self.args.output_dir)
            return
        super()._save(output_dir, state_dict)
