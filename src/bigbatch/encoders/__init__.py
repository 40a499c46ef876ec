"""Encoders: towers that turn text (and later images) into L2-normalised embeddings.

Imports transformers and peft lazily, so ``import bigbatch`` stays light.
"""

from .text import TextEncoder, default_lora_targets

__all__ = ["TextEncoder", "default_lora_targets"]
