"""A text bi-encoder over any Hugging Face ``AutoModel``: pooling (mean, cls, last), L2
normalisation, max length, query/document prefixes, LoRA through peft or full fine-tuning,
gradient checkpointing, and saving in a layout that plain transformers (+ peft) and
sentence-transformers load with the same embeddings.

The encoder is a GradCache tower: ``encoder(input_ids=..., attention_mask=...)`` returns a
``(rows, dim)`` tensor, and :meth:`TextEncoder.tokenize` makes those inputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError, shown
from .base import EncoderBase, clip_for_tokenizer, pool
from .source import (
    check_model_source,
    check_tokenizer_fits,
    hub_load_errors,
    load_pretrained,
    model_positions,
    model_reference,
)

__all__ = ["TextEncoder", "default_lora_targets", "POOLING_MODES", "check_texts",
           "end_with_eos"]

POOLING_MODES = ("mean", "cls", "last")

# LoRA target modules by transformers model_type: attention projections and, for BERT-style
# encoders, the dense layers too (as sentence-transformers' and peft's examples do).
_LORA_TARGETS = {
    "bert": ["query", "key", "value", "dense"],
    "roberta": ["query", "key", "value", "dense"],
    "xlm-roberta": ["query", "key", "value", "dense"],
    "electra": ["query", "key", "value", "dense"],
    "distilbert": ["q_lin", "k_lin", "v_lin", "out_lin"],
    "mpnet": ["q", "k", "v", "o"],
    "t5": ["q", "k", "v", "o"],
    "nomic_bert": ["Wqkv", "out_proj"],
    "modernbert": ["Wqkv", "Wo"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma3_text": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def default_lora_targets(model_type: str) -> list[str]:
    """LoRA target module names for a transformers ``model_type``.

    Raises:
        ConfigError: for an architecture without a default; pass ``lora_target_modules``.
    """
    if model_type in _LORA_TARGETS:
        return list(_LORA_TARGETS[model_type])
    try:  # peft's own table covers many more architectures
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as table
        if model_type in table:
            return list(table[model_type])
    except ImportError:  # pragma: no cover
        pass
    raise ConfigError(f"no default LoRA target modules for model_type {model_type!r}; pass "
                      f"lora_target_modules (--lora-target-modules), e.g. q_proj,v_proj")


def end_with_eos(tokenizer: Any) -> bool:
    """Last-token pooling of a decoder model: pad on the left and end every text with a
    special token, which the embedding is taken from. Qwen3-Embedding's tokenizer does both
    (it appends ``<|endoftext|>``); a base model's tokenizer, which ends texts with no
    special token, is given a post-processor that appends its end-of-text token, saved with
    it, so that sentence-transformers embeds the saved folder the same way. A tokenizer
    without an end-of-text token (BERT's, whose last token is ``[SEP]``) is left as it is.
    Returns whether the tokenizer was changed."""
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eos is None or eos_id is None:
        return False
    changed = tokenizer.padding_side != "left"
    tokenizer.padding_side = "left"
    if tokenizer("a", return_special_tokens_mask=True)["special_tokens_mask"][-1]:
        return changed  # it ends texts with a special token already (Qwen3-Embedding's)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"--pooling last: the tokenizer does not end texts with {eos!r} and "
                          f"is not a fast tokenizer that bigbatch can make do so; use a "
                          f"model folder whose tokenizer.json appends it")
    from tokenizers import processors

    append = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                           special_tokens=[(eos, eos_id)])
    current = backend.post_processor
    backend.post_processor = append if current is None else \
        processors.Sequence([current, append])
    return True


def check_texts(items: Sequence[Any]) -> None:
    """Raises ConfigError unless every item is a text (an image needs a vision-language model)."""
    bad = next((x for x in items if not isinstance(x, str)), None)
    if bad is not None:
        raise ConfigError(f"the text encoder got a {type(bad).__name__} document ({bad}); image "
                          f"documents need a vision-language model (Qwen2-VL, Qwen2.5-VL, "
                          f"Qwen3-VL)")


class TextEncoder(EncoderBase):
    """A Hugging Face encoder with pooling and L2 normalisation.

    Args:
        model: path or hub name for ``AutoModel.from_pretrained`` (a local path here).
        pooling: ``"mean"``, ``"cls"`` or ``"last"`` (last non-padding token). With
            ``"last"`` and a tokenizer that has an end-of-text token (a decoder model such as
            Qwen3, Mistral, Llama), texts are padded on the left and end with that token (a
            tokenizer that does not add it is given a post-processor that does, saved with
            it): the embedding is the end-of-text token's, as Qwen3-Embedding, e5-mistral
            and GritLM embed.
        normalize: L2-normalise the embeddings.
        max_length: tokenizer truncation length (queries and documents).
        query_prefix, doc_prefix: text put before every query / document (instructions).
        exclude_prompt_from_pooling: leave the prefix's tokens (and the tokens the tokenizer
            puts before it, such as ``[CLS]``) out of mean pooling, as GritLM and INSTRUCTOR
            do and as sentence-transformers' ``include_prompt: false`` does: the model still
            attends to the instruction, but the embedding averages the text's tokens only.
        lora_r, lora_alpha, lora_dropout, lora_target_modules: LoRA through peft when
            ``lora_r > 0`` (targets default by architecture); else full fine-tuning.
        gradient_checkpointing: recompute activations in the backward pass; composes with
            the cache (each replay recomputes inside its own chunk).
        dtype: dtype to load the weights in (default float32).
        attn_implementation: transformers' attention implementation (``"sdpa"``,
            ``"eager"``, ``"flash_attention_2"``; None: transformers' default).

    Raises:
        ConfigError: unknown pooling, bad LoRA options, weights missing from the checkpoint.
    """

    _allowed_missing = ("pooler.",)  # BERT's pooler: absent from sentence-transformers folders

    encoder_type = "text"

    def __init__(self, model: str | os.PathLike, *, pooling: str = "mean", normalize: bool = True,
                 max_length: int = 256, query_prefix: str = "", doc_prefix: str = "",
                 lora_r: int = 0, lora_alpha: int = 32, lora_dropout: float = 0.0,
                 lora_target_modules: Sequence[str] | None = None,
                 gradient_checkpointing: bool = False,
                 dtype: torch.dtype | None = None,
                 exclude_prompt_from_pooling: bool = False,
                 attn_implementation: str | None = None) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        check_model_source(model, hub=True)  # a hub name fails fast without a network
        if pooling not in POOLING_MODES:
            raise ConfigError(f"pooling must be one of {POOLING_MODES}, got {shown(pooling)}")
        if exclude_prompt_from_pooling and pooling != "mean":
            raise ConfigError(f"--exclude-instruction-from-pooling applies to mean pooling; "
                              f"with {pooling!r} pooling the embedding is one token's")
        self.exclude_prompt_from_pooling = exclude_prompt_from_pooling
        self.tasks = {}
        self._prompt_lengths: dict[str, int] = {}
        if max_length <= 0:
            raise ConfigError(f"max_length must be > 0, got {max_length}")
        self.model_name = self.base_model_name = model_reference(model)
        self.pooling = pooling
        self.normalize = normalize
        self.max_length = max_length
        self.query_prefix = query_prefix
        self.doc_prefix = doc_prefix
        with hub_load_errors(self.model_name):
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if pooling == "last":
            end_with_eos(self.tokenizer)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        self.model = load_pretrained(self.model_name, self._allowed_missing, **kwargs)
        check_tokenizer_fits(self.tokenizer, self.model, self.model_name)
        limit = model_positions(getattr(self.model.config, "max_position_embeddings", None),
                                getattr(self.model.config, "model_type", ""))
        if limit is not None and self.max_length > limit:  # a longer text would fail inside
            self.max_length = limit  # (a length asked for explicitly: refused before, see
            # encoders.loading and train.build)
        self.lora_r = 0
        if lora_r > 0:
            self._apply_lora(lora_r, lora_alpha, lora_dropout, lora_target_modules)
        if gradient_checkpointing:
            self._enable_gradient_checkpointing()

    def _default_lora_targets(self) -> list[str]:
        return default_lora_targets(self.model.config.model_type)

    # -------------------------------------------------------------- forward
    def tokenize(self, texts: Sequence[str], side: str = "doc",
                 max_length: int | None = None, block: int = 2048) -> dict[str, Tensor]:
        """Tokenize ``texts`` as queries (``side="query"``) or documents, with the prefix.

        Large batches are tokenized ``block`` texts at a time and padded to the batch's
        longest row: a fast tokenizer keeps per-token records (strings, offsets, and the
        overflow of every truncated text) for each text of a call, which for 16,384
        abstracts cut to 32 tokens is over 1 GB alive at once; per block it is freed as
        soon as the block's tensors are taken.
        """
        prefix = self.query_prefix if side == "query" else self.doc_prefix
        keys = ("input_ids", "attention_mask", "token_type_ids")
        length = max_length or self.max_length
        parts = []
        for lo in range(0, max(len(texts), 1), block):
            rows = [prefix + clip_for_tokenizer(t, length) for t in texts[lo:lo + block]]
            enc = self.tokenizer(rows, padding=True,
                                 truncation=True, max_length=length, return_tensors="pt")
            part = {k: v for k, v in enc.items() if k in keys}
            if self.exclude_prompt_from_pooling:
                part["pooling_mask"] = self.pooling_mask(part["attention_mask"], prefix)
            parts.append(part)
            del enc  # drops the per-token records of this block
        if len(parts) == 1:
            return parts[0]
        width = max(p["input_ids"].shape[1] for p in parts)
        left = self.tokenizer.padding_side == "left"
        pad_id = self.tokenizer.pad_token_id or 0
        out = {}
        for k in parts[0]:
            fill = pad_id if k == "input_ids" else 0
            padded = []
            for p in parts:
                extra = width - p[k].shape[1]
                pad = (extra, 0) if left else (0, extra)
                padded.append(torch.nn.functional.pad(p[k], pad, value=fill) if extra else p[k])
            out[k] = torch.cat(padded)
        return out

    def prompt_length(self, prefix: str) -> int:
        """Tokens a row starts with before its text: those the tokenizer puts first (such as
        ``[CLS]``) and the prefix's, as sentence-transformers counts a prompt (the prompt
        tokenized alone, less the special tokens it ends with)."""
        if not prefix:
            return 0
        if prefix not in self._prompt_lengths:
            enc = self.tokenizer(prefix, return_special_tokens_mask=True)
            special = enc["special_tokens_mask"]
            n = len(special)
            while n and special[n - 1]:
                n -= 1
            self._prompt_lengths[prefix] = n
        return self._prompt_lengths[prefix]

    def pooling_mask(self, attention_mask: Tensor, prefix: str) -> Tensor:
        """``attention_mask`` with each row's first :meth:`prompt_length` real tokens zeroed
        (either padding side): the tokens mean pooling averages. A row that is all prompt
        (its text cut away by the max length) keeps its last token."""
        n = self.prompt_length(prefix)
        if n == 0:
            return attention_mask.clone()
        real = attention_mask != 0
        first = real.int().argmax(1, keepdim=True)
        pos = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None]
        out = attention_mask.masked_fill((pos >= first) & (pos < first + n), 0)
        empty = ~(out != 0).any(1)
        if empty.any():
            last = attention_mask.shape[1] - 1 - real.flip(1).int().argmax(1)
            rows = empty.nonzero().squeeze(1)
            out[rows, last[rows]] = attention_mask[rows, last[rows]]
        return out

    def step_inputs(self, items: Sequence[str], side: str,
                    max_length: int | None = None) -> dict[str, Tensor]:
        """What GradCache is given for one tower: the tokenized batch."""
        check_texts(items)
        return self.tokenize(items, side, max_length=max_length)

    def collate_fns(self) -> None:
        return None  # tokenized dicts need no collation

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                token_type_ids: Tensor | None = None,
                pooling_mask: Tensor | None = None) -> Tensor:
        return self._embed(self.model, input_ids, attention_mask, token_type_ids, pooling_mask)

    def _embed(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
               token_type_ids: Tensor | None = None,
               pooling_mask: Tensor | None = None) -> Tensor:
        """``pooling_mask`` (from :meth:`tokenize` with ``exclude_prompt_from_pooling``):
        the tokens pooled, where they differ from those attended to."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = model(**kwargs).last_hidden_state
        emb = pool(hidden, attention_mask if pooling_mask is None else pooling_mask,
                   self.pooling)
        return nn.functional.normalize(emb, dim=-1) if self.normalize else emb

    def encode(self, texts: Sequence[str], side: str = "doc", batch_size: int = 64,
               device: torch.device | str | None = None, progress: str | None = None,
               autocast_dtype: torch.dtype | None = None) -> Tensor:
        """Embed ``texts`` in batches (longest first, so padding is small); returns float32
        embeddings on the CPU in the input order. Documents go through the frozen document
        tower in query-side-tune mode."""
        check_texts(texts)
        return self._encode(texts, side, batch_size, device, progress, autocast_dtype,
                            order=sorted(range(len(texts)), key=lambda i: -len(texts[i])),
                            make_batch=self.tokenize, unit="text")

    # ----------------------------------------------------------------- saving
    def settings(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "normalize": self.normalize,
                "max_length": self.max_length, "query_prefix": self.query_prefix,
                "doc_prefix": self.doc_prefix,
                "exclude_prompt_from_pooling": self.exclude_prompt_from_pooling}

    def _save_extras(self, path: Path) -> None:
        """sentence-transformers' files, so that ``SentenceTransformer(path)`` loads the folder
        with the same embeddings as this encoder (and ``AutoModel.from_pretrained(path)``
        loads it too: peft adapters through transformers' peft integration)."""
        dim = self.model.config.hidden_size
        modules = [{"idx": 0, "name": "0", "path": "", "type":
                    "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                    "sentence_transformers.models.Pooling"}]
        if self.normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type":
                            "sentence_transformers.models.Normalize"})
            (path / "2_Normalize").mkdir(exist_ok=True)
        (path / "modules.json").write_text(json.dumps(modules, indent=2))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": dim,
            "pooling_mode_cls_token": self.pooling == "cls",
            "pooling_mode_mean_tokens": self.pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": self.pooling == "last",
            "include_prompt": not self.exclude_prompt_from_pooling,
        }, indent=2))
        (path / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": self.max_length, "do_lower_case": False}, indent=2))
        prompts = {"query": self.query_prefix, "document": self.doc_prefix}
        for task, p in sorted(self.tasks.items()):  # SentenceTransformer.encode(prompt_name=)
            prompts[f"{task}_query"] = p.get("query", self.query_prefix)
            prompts[f"{task}_document"] = p.get("doc", self.doc_prefix)
        st_config = {"prompts": prompts, "default_prompt_name": None,
                     "similarity_fn_name": "cosine", "model_type": "SentenceTransformer"}
        if getattr(self, "matryoshka_dims", None):
            # the widths trained (Matryoshka); SentenceTransformer(path, truncate_dim=d) picks
            # one, while a "truncate_dim" key here would truncate every encode() by default
            st_config["matryoshka_dims"] = list(self.matryoshka_dims)
        (path / "config_sentence_transformers.json").write_text(json.dumps(st_config,
                                                                           indent=2))
