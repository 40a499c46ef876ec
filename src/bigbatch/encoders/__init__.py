"""Encoders: towers that turn text (and later images) into L2-normalised embeddings.

Imports transformers and peft lazily, so ``import bigbatch`` stays light.
"""

from .loading import load_encoder
from .text import TextEncoder, default_lora_targets

__all__ = ["TextEncoder", "default_lora_targets", "load_encoder"]
