"""Building a training run's parts from its configuration: the device, the encoder (text, text
multi-vector or vision-language, checked against the data and the model's positions), the
loss, the optimizer and the GradCache engine with its towers and chunk sizes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..engine import distributed as D
from ..engine.gradcache import GradCache
from ..errors import ConfigError
from ..losses import CorpusInfoNCE, InfoNCE
from ..losses.matryoshka import Matryoshka, check_dims
from ..losses.maxsim import MaxSimInfoNCE
from .config import AUTO, TrainConfig
from .model_defaults import model_positions

__all__ = ["AUTOCAST_DTYPES", "device_for", "build_encoder", "build_loss", "build_optimizer",
           "build_cache", "build_deepspeed", "embedding_width", "check_matryoshka_width"]

# --dtype: the autocast dtype of the encoder (None: float32, no autocast)
AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for(config: TrainConfig, info: D.WorldInfo) -> torch.device:
    """``--device``, else this rank's accelerator (``cuda:LOCAL_RANK``), else the CPU."""
    if config.device:
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


def _check_max_length(config: TrainConfig, model_config: Any) -> None:
    """A max length beyond the model's position embeddings fails inside the model at the
    first long batch, possibly hours in; refuse it now."""
    limit = model_positions(getattr(model_config, "max_position_embeddings", None),
                            getattr(model_config, "model_type", ""))
    if limit is None:
        return
    for name in ("max_length", "query_max_length", "query_length"):
        value = getattr(config, name)
        if value and value > limit:
            raise ConfigError(f"--{name.replace('_', '-')}: {value} is more than the "
                              f"{limit} positions {config.model} has")


def _check_attn_implementation(name: str | None) -> None:
    """``--attn-implementation flash_attention_2`` needs the flash-attn package (checked
    before the model loads, with what to do, rather than by transformers' import error)."""
    import importlib.util

    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("--attn-implementation flash_attention_2 needs the flash-attn "
                          "package (pip install flash-attn, on a machine with a GPU); use "
                          "--attn-implementation sdpa")


def build_encoder(config: TrainConfig, records: Sequence, lora_r: int) -> Any:
    """The text or vision-language encoder the configuration asks for (``--encoder auto``:
    by the model folder), with a LoRA adapter of rank ``lora_r`` (0: full fine-tuning).

    Raises:
        ConfigError: image documents for a text model, a max length beyond the model's
            positions, flash_attention_2 without flash-attn, or a bad encoder option.
    """
    from ..data.records.loader import summarize
    from ..encoders import TextEncoder, VisionLanguageEncoder, is_vision_language_model

    _check_attn_implementation(config.attn_implementation)
    encoder_type = config.encoder
    if encoder_type == "auto":
        encoder_type = "vision-language" if is_vision_language_model(config.model) else "text"
    if encoder_type == "text":
        image = summarize(records).first_image
        if image is not None:
            raise ConfigError(f"{image[0]}:{image[1]}: the training data has image "
                              f"documents, but --model {config.model} is a text model; use a "
                              f"Qwen2-VL / Qwen2.5-VL / Qwen3-VL model")
        extra = {"exclude_prompt_from_pooling": True} \
            if config.exclude_instruction_from_pooling else {}
        common = dict(max_length=config.max_length, query_prefix=config.query_prefix,
                      doc_prefix=config.doc_prefix, lora_r=lora_r, lora_alpha=config.lora_alpha,
                      lora_dropout=config.lora_dropout,
                      lora_target_modules=config.lora_target_modules,
                      gradient_checkpointing=config.gradient_checkpointing,
                      attn_implementation=config.attn_implementation)
        if config.pooling == "multivector":
            enc = _multivector_encoder(config, common)
        else:
            enc = TextEncoder(config.model, pooling=config.pooling, **common, **extra)
        _check_max_length(config, enc.model.config)
        return enc
    if config.query_length:
        raise ConfigError(f"--query-length: query expansion with mask tokens is for text "
                          f"models; {config.model} is a vision-language model")
    if config.exclude_instruction_from_pooling:
        raise ConfigError(f"--exclude-instruction-from-pooling: {config.model} is a "
                          f"vision-language model, pooled by its last token (never an "
                          f"instruction token); leave the option out")
    from ..encoders.vision import DOC_INSTRUCTION, QUERY_INSTRUCTION
    from ..encoders.vision_multivector import PROJECTION, MultiVectorVisionEncoder, projection_weights

    if config.pooling != "multivector" and projection_weights(config.model):
        # a ColQwen-style folder (colpali-engine's, or bigbatch's): one vector per text would
        # drop its per-token projection and train another kind of model, silently
        raise ConfigError(f"--model {config.model} is a ColQwen-style multi-vector model (its "
                          f"weights hold {PROJECTION}); train it with --pooling multivector "
                          f"(one vector per token), or start from its base model for one "
                          f"vector per text")

    # --pooling multivector: ColQwen-style, one projected vector per token
    cls, extra = (MultiVectorVisionEncoder, {"dim": config.multivector_dim}) \
        if config.pooling == "multivector" else (VisionLanguageEncoder, {})
    return cls(
        config.model, **extra, query_instruction=config.query_instruction or QUERY_INSTRUCTION,
        doc_instruction=config.doc_instruction or DOC_INSTRUCTION,
        max_num_visual_tokens=config.max_num_visual_tokens,
        min_num_visual_tokens=config.min_num_visual_tokens, max_length=config.max_length,
        freeze_vision=config.freeze_vision, lora_r=lora_r, lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout, lora_target_modules=config.lora_target_modules,
        gradient_checkpointing=config.gradient_checkpointing,
        attn_implementation=config.attn_implementation)


def _multivector_encoder(config: TrainConfig, common: dict[str, Any]) -> Any:
    """The ColBERT-style text encoder: a multi-vector folder's own settings (markers,
    masks), then the configuration's."""
    from ..encoders.text_multivector import MultiVectorTextEncoder, multivector_settings

    settings = multivector_settings(config.model) or {}
    settings.update(common, dim=config.multivector_dim,
                    query_length=config.query_length or settings.get("query_length"),
                    query_expansion=config.query_length > 0)
    return MultiVectorTextEncoder(config.model, **settings)


def build_loss(config: TrainConfig, corpus: Any, device: torch.device) -> torch.nn.Module:
    """InfoNCE over the batch's documents (with ``--extra-negatives``), or with ``corpus`` (a
    :class:`~bigbatch.train.corpus_negatives.FixedCorpus`) CorpusInfoNCE over its embeddings; with
    ``--pooling multivector``, MaxSimInfoNCE (scores divided by the query's token count, so
    the temperature means what it means for one vector per text). With
    ``--matryoshka-dims``, the loss wrapped in :class:`~bigbatch.Matryoshka`."""
    loss = _base_loss(config, corpus).to(device)
    if config.matryoshka_dims:
        loss = Matryoshka(loss, dims=config.matryoshka_dims, weights=config.matryoshka_weights)
    return loss


def _base_loss(config: TrainConfig, corpus: Any) -> torch.nn.Module:
    learnable = not config.fixed_temperature
    if config.pooling == "multivector":
        return MaxSimInfoNCE(temperature=config.temperature, learnable_temperature=learnable,
                             symmetric=config.symmetric, normalize_query=True,
                             block_size=config.loss_block_size or None)
    # --loss-block-size: unset is automatic (bounded blocks), 0 the dense loss
    blocks = {"block_size": config.loss_block_size or None, "dense": config.loss_block_size == 0}
    if corpus is not None:
        return CorpusInfoNCE(corpus.emb, temperature=config.temperature,
                             learnable_temperature=learnable, **blocks)
    return InfoNCE(temperature=config.temperature, learnable_temperature=learnable,
                   symmetric=config.symmetric, extra_negatives=config.extra_negatives, **blocks,
                   guide_margin=config.guide_margin,
                   guide_margin_type=config.guide_margin_type, distill=config.distill,
                   distill_weight=config.distill_weight,
                   teacher_temperature=config.teacher_temperature)


def embedding_width(config: TrainConfig, encoder: Any) -> int | None:
    """The width of the encoder's embeddings (``--multivector-dim`` for token vectors, else
    the model's hidden size), or None when its configuration does not say."""
    if config.pooling == "multivector":
        return config.multivector_dim
    cfg = getattr(getattr(encoder, "model", None), "config", None)
    width = getattr(cfg, "hidden_size", None)
    if width is None:  # a vision-language model: its text model's width
        width = getattr(getattr(cfg, "text_config", None), "hidden_size", None)
    return width if isinstance(width, int) else None


def check_matryoshka_width(config: TrainConfig, encoder: Any) -> None:
    """``--matryoshka-dims`` against the model's embedding width, before any step; the
    encoder records the dims, so every saved model carries them.

    Raises:
        ConfigError: a dimension larger than the width.
    """
    if not config.matryoshka_dims:
        return
    check_dims(config.matryoshka_dims, config.matryoshka_weights,
               width=embedding_width(config, encoder), what="--matryoshka-dims")
    encoder.matryoshka_dims = list(config.matryoshka_dims)


def build_optimizer(config: TrainConfig, model_params: list[torch.nn.Parameter],
                    loss_fn: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the model's trainable parameters (with weight decay) and the loss's
    temperature (without, at ``--logit-scale-lr`` or ``--lr``)."""
    groups = [{"params": model_params, "weight_decay": config.weight_decay}]
    if list(loss_fn.parameters()):
        groups.append({"params": list(loss_fn.parameters()), "weight_decay": 0.0,
                       "lr": config.logit_scale_lr or config.lr})
    return torch.optim.AdamW(groups, lr=config.lr)


def build_deepspeed(config: TrainConfig, encoder: torch.nn.Module,
                    model_params: list[torch.nn.Parameter], max_steps: int,
                    world_size: int) -> Any:
    """``--deepspeed``: the DeepSpeed engine over the encoder, with AdamW over the model's
    trainable parameters and its warmup and schedule (stepped by ``engine.step()``); the
    temperature stays with the run's own optimizer (see
    :mod:`bigbatch.integrations.deepspeed`). Under ZeRO-3 the encoder's frame for saving
    whole weights is kept first (:func:`bigbatch.train.sharding.remember_whole`)."""
    from ..integrations.deepspeed import initialize, read_config, zero_stage
    from .schedule import make_scheduler
    from .sharding import remember_whole

    ds_config = read_config(config.deepspeed, batch_size=config.batch_size,
                            max_grad_norm=config.max_grad_norm, world_size=world_size)
    if zero_stage(ds_config) == 3:  # partitioned by initialize: saved through a whole frame
        remember_whole(encoder, D.world_info().is_main)
    optimizer = torch.optim.AdamW([{"params": model_params,
                                    "weight_decay": config.weight_decay}], lr=config.lr)
    scheduler = make_scheduler(optimizer, config.scheduler, config.warmup_steps, max_steps)
    return initialize(encoder, optimizer, ds_config, lr_scheduler=scheduler)


def build_cache(config: TrainConfig, encoder: Any, loss_fn: torch.nn.Module, corpus: Any,
                scaler: Any, device: torch.device, engine: Any = None,
                size: Callable[[GradCache], Any] | None = None) -> GradCache:
    """The GradCache engine over the encoder's towers. Its chunk sizes (``chunk_sizes``,
    which the run reads afterwards) are decided here, once: ``--grad-cache-chunk`` for
    documents and ``--query-grad-cache-chunk`` (default: the same) for queries, each at most
    ``--batch-size``; ``auto`` ones by ``size(cache)``, which measures and chooses them
    (:func:`bigbatch.train.memory_check.plan_run_chunks`); query-side tuning's direct
    backward is one query chunk. Query-side tuning embeds documents with the frozen document
    tower, or with ``corpus`` takes no document tower at all. With a DeepSpeed ``engine``
    both towers call it, and DeepSpeed reduces the model's gradients
    (:func:`bigbatch.integrations.deepspeed.deepspeed_cache`).
    """
    query_side = config.mode == "query-side-tune"

    def at_most_batch(value: int | str) -> int | str:
        return value if value == AUTO else min(value, config.batch_size)

    chunk = at_most_batch(config.grad_cache_chunk)
    q_chunk = at_most_batch(config.query_grad_cache_chunk or chunk)
    if query_side and config.query_side_backward == "direct":
        q_chunk = config.batch_size  # one chunk: its graph is kept, backward runs directly
    if corpus is not None:
        towers, chunks = {"query": encoder}, {"query": q_chunk}
    else:
        doc_tower = encoder.frozen_doc_tower() if query_side else encoder
        towers, chunks = {"query": encoder, "doc": doc_tower}, {"query": q_chunk, "doc": chunk}
    collate = encoder.collate_fns()
    if collate is not None:
        collate = {name: collate[name] for name in towers}
    tokens = None  # --grad-cache-tokens: token budgets of the tokenized towers
    if config.grad_cache_tokens:
        if collate is not None:
            raise ConfigError("--grad-cache-tokens needs text models, whose batches are "
                              "tokenized before they are cut into chunks; a vision-language "
                              "model's pages are collated chunk by chunk: use "
                              "--grad-cache-chunk there")
        direct = query_side and config.query_side_backward == "direct"  # one query chunk
        tokens = {name: config.grad_cache_tokens for name in towers
                  if not (direct and name == "query")}
    options = dict(collate_fn=collate, autocast_dtype=AUTOCAST_DTYPES[config.dtype],
                   scaler=scaler, device=device, sort_by_length=True,
                   cross_device=corpus is None, chunk_tokens=tokens,
                   keep_embeddings=("doc",) if config.negative_queue else ())  # for the queue
    if engine is not None:  # (auto sizes are refused with --deepspeed)
        from ..integrations.deepspeed import deepspeed_cache
        return deepspeed_cache(engine, loss_fn, chunks, towers=list(towers), **options)
    if config.auto_sizes:
        options["memory_budget"] = config.memory_budget
    cache = GradCache(towers, loss_fn, chunk_size=chunks, **options)
    if config.auto_sizes and size is not None:
        size(cache)
    return cache
