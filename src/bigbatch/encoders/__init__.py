"""Encoders: towers that turn text (TextEncoder; MultiVectorTextEncoder: one vector per token,
ColBERT-style) and page images (VisionLanguageEncoder, for Qwen2-VL / Qwen2.5-VL / Qwen3-VL;
MultiVectorVisionEncoder: one vector per token, ColQwen-style)
into L2-normalised embeddings. All fulfil the contract declared in
:class:`~bigbatch.encoders.base.EncoderBase`.

Imports transformers and peft lazily, and the names here when first used, so ``import
bigbatch`` and ``bigbatch.encoders.instructions`` stay light.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__all__ = ["EncoderBase", "TextEncoder", "MultiVectorTextEncoder", "VisionLanguageEncoder",
           "MultiVectorVisionEncoder",
           "FrozenDocTower", "default_lora_targets", "load_encoder", "is_vision_language_model"]

__getattr__, __dir__ = lazy_names(__name__, {
    "EncoderBase": ".base", "FrozenDocTower": ".base", "load_encoder": ".loading",
    "TextEncoder": ".text", "default_lora_targets": ".text",
    "MultiVectorTextEncoder": ".text_multivector", "VisionLanguageEncoder": ".vision",
    "is_vision_language_model": ".vision", "MultiVectorVisionEncoder": ".vision_multivector"})

if TYPE_CHECKING:  # for type checkers, editors and the docs: the same names, imported eagerly
    from .base import EncoderBase, FrozenDocTower
    from .loading import load_encoder
    from .text import TextEncoder, default_lora_targets
    from .text_multivector import MultiVectorTextEncoder
    from .vision import VisionLanguageEncoder, is_vision_language_model
    from .vision_multivector import MultiVectorVisionEncoder
