"""Saving a model without importing DeepSpeed when the run does not use it.

transformers' ``save_pretrained`` asks accelerate to unwrap the model from its distributed
containers, and accelerate, whenever DeepSpeed is installed, imports it to test whether the
model is a DeepSpeed engine. That import costs seconds and prints DeepSpeed's accelerator
warning at the end of a run that never used DeepSpeed. While ``deepspeed`` is not imported no
object can be one of its engines, so :func:`saving_without_deepspeed` makes that test answer
"not available" for the duration of the save; once DeepSpeed is imported (a ``--deepspeed``
run) nothing is changed.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["saving_without_deepspeed"]


@contextmanager
def saving_without_deepspeed() -> Iterator[None]:
    """Within the block, accelerate's unwrapping does not import DeepSpeed (unless it is
    already imported)."""
    module = None
    if "deepspeed" not in sys.modules:
        try:
            module = importlib.import_module("accelerate.utils.other")
        except ImportError:  # no accelerate: transformers unwraps by itself
            module = None
    if module is None or not callable(getattr(module, "is_deepspeed_available", None)):
        yield
        return
    available = module.is_deepspeed_available
    module.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        module.is_deepspeed_available = available
