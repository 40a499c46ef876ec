"""Encoders: towers that turn text (TextEncoder; MultiVectorTextEncoder: one vector per token,
ColBERT-style) and page images (VisionLanguageEncoder, for Qwen2-VL / Qwen2.5-VL / Qwen3-VL;
MultiVectorVisionEncoder: one vector per token, ColQwen-style)
into L2-normalised embeddings. All fulfil the contract declared in
:class:`~bigbatch.encoders.base.EncoderBase`.

Imports transformers and peft lazily, so ``import bigbatch`` stays light.
"""

from .base import EncoderBase, FrozenDocTower
from .loading import load_encoder
from .text import TextEncoder, default_lora_targets
from .text_multivector import MultiVectorTextEncoder
from .vision import VisionLanguageEncoder, is_vision_language_model
from .vision_multivector import MultiVectorVisionEncoder

__all__ = ["EncoderBase", "TextEncoder", "MultiVectorTextEncoder", "VisionLanguageEncoder",
           "MultiVectorVisionEncoder",
           "FrozenDocTower", "default_lora_targets", "load_encoder", "is_vision_language_model"]
