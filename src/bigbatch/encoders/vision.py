"""A vision-language bi-encoder over Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers' own
model classes): queries are text, documents are page images, text, or both.

Each input is one ChatML prompt, as the Qwen embedding models are trained:

    <|im_start|>system\\n{instruction}<|im_end|>\\n<|im_start|>user\\n
    [<|vision_start|><|image_pad|>...<|vision_end|>]{text}<|im_end|>\\n<|im_start|>assistant\\n

and its embedding is the last token's hidden state (padding side handled), L2-normalised.
``max_num_visual_tokens`` becomes the image processor's pixel budget for the family
(a visual token covers 28 x 28 pixels in Qwen2/2.5-VL, 32 x 32 in Qwen3-VL). The vision
tower is frozen by default; LoRA goes on the language model's q/k/v/o projections.

The multimodal rope state (``rope_deltas``, cached by the model after an image call) is
reset before and after every call, and text-only calls get explicit position ids, so an
image call never leaks into a text call.

The encoder is a GradCache tower fed raw examples: :meth:`VisionLanguageEncoder.collate`
turns a chunk of examples into model inputs, loading its images only then. An example is a
string (text) or an image document: anything with a ``path`` attribute (the page image) and
optionally a ``text`` shown beside it, such as :class:`bigbatch.data.records.image_checks.ImageDoc`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError, InputError
from .base import EncoderBase, check_side, clip_for_tokenizer, pool
from .image_inputs import image_text, is_image_doc, load_image
from .instructions import DOC_INSTRUCTION, QUERY_INSTRUCTION
from .source import (
    check_model_source,
    check_tokenizer_fits,
    hub_load_errors,
    load_pretrained,
    model_reference,
    read_json,
)

__all__ = ["VisionLanguageEncoder", "VL_MODEL_TYPES", "QUERY_INSTRUCTION", "DOC_INSTRUCTION",
           "is_vision_language_model", "pixels_per_visual_token"]

TEMPLATE = ("<|im_start|>system\n{instruction}<|im_end|>\n<|im_start|>user\n{content}"
            "<|im_end|>\n<|im_start|>assistant\n")
# side in pixels of the square one visual token covers (patch size x spatial merge size)
VL_MODEL_TYPES = {"qwen2_vl": 28, "qwen2_5_vl": 28, "qwen3_vl": 32}
_LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)$"


def pixels_per_visual_token(model_type: str) -> int:
    """Pixels one visual token covers: 28*28 = 784 (Qwen2/2.5-VL), 32*32 = 1024 (Qwen3-VL)."""
    if model_type not in VL_MODEL_TYPES:
        raise ConfigError(f"not a supported vision-language model type: {model_type!r} "
                          f"(supported: {sorted(VL_MODEL_TYPES)})")
    return VL_MODEL_TYPES[model_type] ** 2


def is_vision_language_model(path: str | os.PathLike) -> bool:
    """Whether the model folder (or a bigbatch output / adapter over one) is a supported
    vision-language model."""
    p = Path(path)
    meta = p / "bigbatch_encoder.json"
    if meta.exists():
        return read_json(meta).get("encoder") == "vision-language"
    adapter = p / "adapter_config.json"
    if adapter.exists() and not (p / "config.json").exists():
        base = read_json(adapter).get("base_model_name_or_path")
        return isinstance(base, str) and bool(base) and is_vision_language_model(base)
    cfg = p / "config.json"
    if cfg.exists():
        return read_json(cfg).get("model_type") in VL_MODEL_TYPES
    return False


class VisionLanguageEncoder(EncoderBase):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL as a bi-encoder (last-token pooling, L2 norm).

    Args:
        model: path of the model folder (weights, tokenizer, image processor).
        query_instruction, doc_instruction: the system instruction of queries / documents.
        max_num_visual_tokens: visual tokens per image at most (the pixel budget is this
            times the family's pixels per token); ``min_num_visual_tokens`` at least.
        max_length: truncation length, in tokens, of the text part of an input (images and
            the prompt around the text are never cut).
        normalize: L2-normalise the embeddings.
        freeze_vision: keep the vision tower's weights fixed (default). With LoRA and
            ``freeze_vision=False`` the vision tower is trained fully and saved with the
            adapter (peft ``modules_to_save``).
        lora_r, lora_alpha, lora_dropout, lora_target_modules: LoRA through peft when
            ``lora_r > 0``, on the language model's q/k/v/o projections by default.
        gradient_checkpointing: recompute the language model's activations in backward.
        dtype: dtype to load the weights in (default float32).
        attn_implementation: transformers' attention implementation (``"sdpa"``,
            ``"eager"``, ``"flash_attention_2"``; None: transformers' default).

    Raises:
        ConfigError: an unsupported architecture or impossible option.
    """

    encoder_type = "vision-language"
    prompt_attrs = {"query": "query_instruction", "doc": "doc_instruction"}

    def __init__(self, model: str | os.PathLike, *, query_instruction: str = QUERY_INSTRUCTION,
                 doc_instruction: str = DOC_INSTRUCTION, max_num_visual_tokens: int = 256,
                 min_num_visual_tokens: int = 4, max_length: int = 512, normalize: bool = True,
                 freeze_vision: bool = True, lora_r: int = 0, lora_alpha: int = 32,
                 lora_dropout: float = 0.0, lora_target_modules: Sequence[str] | None = None,
                 gradient_checkpointing: bool = False, dtype: torch.dtype | None = None,
                 attn_implementation: str | None = None) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        check_model_source(model, hub=True)  # a hub name fails fast without a network
        self.model_name = self.base_model_name = model_reference(model)
        with hub_load_errors(self.model_name):
            config = AutoConfig.from_pretrained(self.model_name)
        self.model_type = config.model_type
        self.pixels_per_token = pixels_per_visual_token(self.model_type)
        if max_num_visual_tokens <= 0 or min_num_visual_tokens <= 0:
            raise ConfigError(f"max_num_visual_tokens and min_num_visual_tokens must be > 0, "
                              f"got {max_num_visual_tokens} and {min_num_visual_tokens}")
        if min_num_visual_tokens > max_num_visual_tokens:
            raise ConfigError(f"min_num_visual_tokens ({min_num_visual_tokens}) is more than "
                              f"max_num_visual_tokens ({max_num_visual_tokens})")
        if max_length <= 0:
            raise ConfigError(f"max_length must be > 0, got {max_length}")
        self.query_instruction = query_instruction
        self.doc_instruction = doc_instruction
        self.tasks = {}
        self.max_num_visual_tokens = max_num_visual_tokens
        self.min_num_visual_tokens = min_num_visual_tokens
        self.max_length = max_length
        self.normalize = normalize
        self.pooling = "last"
        self.freeze_vision = freeze_vision
        with hub_load_errors(self.model_name):
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_name)
            self.image_processor = AutoImageProcessor.from_pretrained(self.model_name)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        kwargs = {"dtype": dtype} if dtype is not None else {}
        if attn_implementation is not None:  # sdpa, eager, flash_attention_2
            kwargs["attn_implementation"] = attn_implementation
        self.model = load_pretrained(self.model_name, **kwargs)
        check_tokenizer_fits(self.tokenizer, self.model, self.model_name)
        self.image_token_id = int(config.image_token_id)
        self.vision_start_id = self._special_id(config, "vision_start_token_id", "<|vision_start|>")
        self.vision_end_id = self._special_id(config, "vision_end_token_id", "<|vision_end|>")
        self._template_cache: dict[str, tuple[list[int], list[int]]] = {}
        for name, text in (("query_instruction", query_instruction),
                           ("doc_instruction", doc_instruction)):
            self.check_prompt(name, text)
        self.merge = int(getattr(self.image_processor, "merge_size", 2))
        if freeze_vision:
            self._vision().requires_grad_(False)
        self.lora_r = 0
        if lora_r > 0:
            self._apply_lora(lora_r, lora_alpha, lora_dropout, lora_target_modules)
        if gradient_checkpointing:
            self._enable_gradient_checkpointing()

    def check_prompt(self, name: str, text: str) -> None:
        """Refuse an instruction holding a vision token: the prompt places those itself.

        Raises:
            ConfigError: naming ``name`` and the tokens.
        """
        bad = [t for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                           "<|video_pad|>") if t in text]
        if bad:
            raise ConfigError(f"{name} contains the vision token(s) {bad}: the prompt "
                              f"places image tokens itself")

    def _special_id(self, config: Any, attr: str, token: str) -> int:
        value = getattr(config, attr, None)
        if value is None:
            value = self.tokenizer.convert_tokens_to_ids(token)
        if value is None or value == self.tokenizer.unk_token_id:
            raise ConfigError(f"{self.model_name}: the tokenizer has no {token} token")
        return int(value)

    # ------------------------------------------------------------ model parts
    def _core(self, model: nn.Module | None = None) -> nn.Module:
        """The ``Qwen*VLModel`` (under peft and task heads): it holds ``rope_deltas``."""
        m = model if model is not None else self.model
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        while not hasattr(m, "rope_deltas") and hasattr(m, "model"):
            m = m.model
        return m

    def _vision(self) -> nn.Module:
        return self._core().visual

    def _default_lora_targets(self) -> str:
        return _LORA_TARGETS

    def _lora_modules_to_save(self) -> list[str] | None:
        return None if self.freeze_vision else ["visual"]

    def reset_rope_state(self, model: nn.Module | None = None) -> None:
        """Forget the rope offsets the model cached from its last multimodal call."""
        core = self._core(model)
        if hasattr(core, "rope_deltas"):
            core.rope_deltas = None

    # ------------------------------------------------------------------ inputs
    @property
    def pixel_budget(self) -> tuple[int, int]:
        """(min_pixels, max_pixels) given to the image processor."""
        return (self.min_num_visual_tokens * self.pixels_per_token,
                self.max_num_visual_tokens * self.pixels_per_token)

    def _template_ids(self, instruction: str) -> tuple[list[int], list[int]]:
        """Token ids of the prompt before and after the content, for one instruction."""
        if instruction not in self._template_cache:
            head, tail = TEMPLATE.split("{content}")
            self._template_cache[instruction] = tuple(
                self.tokenizer(part, add_special_tokens=False)["input_ids"]
                for part in (head.replace("{instruction}", instruction), tail))
        return self._template_cache[instruction]

    def _text_ids(self, texts: list[str]) -> list[list[int]]:
        """Each user text tokenized once, cut to ``max_length`` tokens. The text is taken
        literally: a special token written in it (``<|image_pad|>``, ``<|im_end|>``) becomes
        ordinary text tokens, so it can neither fake an image slot nor end the turn."""
        if not texts:
            return []
        texts = [clip_for_tokenizer(t, self.max_length) for t in texts]
        return self.tokenizer(texts, add_special_tokens=False, truncation=True,
                              max_length=self.max_length, split_special_tokens=True)["input_ids"]

    def collate(self, items: Sequence[Any], side: str = "doc") -> dict[str, Tensor]:
        """Model inputs for a chunk of queries (``side="query"``) or documents: texts and/or
        image documents (loaded here). Returns input_ids, attention_mask and, when the
        chunk has images, pixel_values, image_grid_thw and mm_token_type_ids.

        Raises:
            InputError: an item that is neither text nor an image document.
            DataError: an image that cannot be read (naming its file).
        """
        check_side(side)
        instruction = self.query_instruction if side == "query" else self.doc_instruction
        images, texts = [], []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
            elif is_image_doc(item):
                images.append(load_image(item.path))
                texts.append(image_text(item))
            else:
                raise InputError(f"a vision-language input must be text or an ImageDoc, got "
                                 f"{type(item).__name__}")
        grid = None
        out: dict[str, Tensor] = {}
        if images:
            lo, hi = self.pixel_budget
            vis = self.image_processor(images=images, return_tensors="pt",
                                       size={"shortest_edge": lo, "longest_edge": hi})
            out["pixel_values"] = vis["pixel_values"]
            grid = vis["image_grid_thw"]
            out["image_grid_thw"] = grid
        counts = iter([] if grid is None else (grid.prod(-1) // self.merge ** 2).tolist())
        before, after = self._template_ids(instruction)
        nonempty = [t for t in texts if t]
        text_ids = iter(self._text_ids(nonempty))
        rows = []
        for item, text in zip(items, texts):
            content = list(next(text_ids)) if text else []
            if is_image_doc(item):
                content = ([self.vision_start_id] + [self.image_token_id] * next(counts)
                           + [self.vision_end_id] + content)
            rows.append(before + content + after)
        tok = self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        out["input_ids"] = tok["input_ids"]
        out["attention_mask"] = tok["attention_mask"]
        if images:
            out["mm_token_type_ids"] = (tok["input_ids"] == self.image_token_id).int()
        return out

    def collate_query(self, items: Sequence[Any]) -> dict[str, Tensor]:
        return self.collate(items, "query")

    def collate_doc(self, items: Sequence[Any]) -> dict[str, Tensor]:
        return self.collate(items, "doc")

    def step_inputs(self, items: Sequence[Any], side: str,
                    max_length: int | None = None) -> list:
        """What GradCache is given for one tower: the raw examples (collated per chunk)."""
        return list(items)

    def collate_fns(self) -> dict[str, Any]:
        return {"query": self.collate_query, "doc": self.collate_doc}

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor | None = None,
                image_grid_thw: Tensor | None = None,
                mm_token_type_ids: Tensor | None = None) -> Tensor:
        return self._embed(self.model, input_ids, attention_mask, pixel_values, image_grid_thw,
                           mm_token_type_ids)

    def _embed(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
               pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
               mm_token_type_ids: Tensor | None = None) -> Tensor:
        hidden = self.hidden_states(model, input_ids, attention_mask, pixel_values,
                                    image_grid_thw, mm_token_type_ids)
        emb = pool(hidden, attention_mask, "last")
        return nn.functional.normalize(emb, dim=-1) if self.normalize else emb

    def hidden_states(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                      pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
                      mm_token_type_ids: Tensor | None = None) -> Tensor:
        """The last hidden states ``(rows, tokens, hidden)`` of ``model`` for one chunk of
        inputs (text-only rows get explicit positions; the rope state is reset around)."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask,
                                  "use_cache": False}
        if pixel_values is not None:
            kwargs.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                          mm_token_type_ids=mm_token_type_ids if mm_token_type_ids is not None
                          else (input_ids == self.image_token_id).int())
        else:  # text only: 1-D positions over the real tokens, the same on all 3 rope axes
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            kwargs["position_ids"] = pos.unsqueeze(0).expand(3, -1, -1)
        self.reset_rope_state(model)
        try:
            return model(**kwargs).last_hidden_state
        finally:
            self.reset_rope_state(model)

    def encode(self, items: Sequence[Any], side: str = "doc", batch_size: int = 16,
               device: torch.device | str | None = None, progress: str | None = None,
               autocast_dtype: torch.dtype | None = None) -> Tensor:
        """Embed texts and/or images in batches; float32 embeddings on the CPU, input order.
        Documents go through the frozen document tower in query-side-tune mode."""
        # images first, then texts longest first: similar shapes share a batch
        order = sorted(range(len(items)), key=lambda i: (not is_image_doc(items[i]),
                                                         -len(str(items[i]))))
        return self._encode(items, side, batch_size, device, progress, autocast_dtype,
                            order=order, make_batch=self.collate, unit="item")

    # ----------------------------------------------------------------- saving
    def settings(self) -> dict[str, Any]:
        return {"encoder": self.encoder_type, "model_type": self.model_type,
                "query_instruction": self.query_instruction,
                "doc_instruction": self.doc_instruction,
                "max_num_visual_tokens": self.max_num_visual_tokens,
                "min_num_visual_tokens": self.min_num_visual_tokens,
                "max_length": self.max_length, "normalize": self.normalize,
                "freeze_vision": self.freeze_vision, "pooling": self.pooling}

    def _save_extras(self, path: Path) -> None:
        """The image processor, with the pixel budget. The folder loads with plain
        transformers (+ peft for an adapter), standard key layout:
        ``AutoModel.from_pretrained(path)`` for merged or full weights,
        ``PeftModel.from_pretrained(AutoModel.from_pretrained(base), path)`` for an
        adapter."""
        import copy
        proc = copy.deepcopy(self.image_processor)
        lo, hi = self.pixel_budget
        proc.size = {"shortest_edge": lo, "longest_edge": hi}
        proc.save_pretrained(path)
