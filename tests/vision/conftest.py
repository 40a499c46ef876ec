"""Fixtures for the vision-language tests: tiny random Qwen-VL models (built from their config
classes, with a locally built byte-level tokenizer) and a few random page images."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory):
    """``tiny_vl(family, dropout=0.0)`` -> path of a tiny random model of that family."""
    from bigbatch.encoders.tiny import build_tiny_vl

    root = tmp_path_factory.mktemp("tiny_vl")

    def make(family: str, dropout: float = 0.0):
        return build_tiny_vl(root / f"{family}-{dropout}", family, dropout=dropout)
    return make


@pytest.fixture(scope="session")
def page_images(tmp_path_factory):
    """Eight random RGB images of different sizes (PNG)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("pages")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(8):
        h, w = 100 + 23 * i, 80 + 17 * (7 - i)
        p = root / f"page{i}.png"
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(p)
        paths.append(str(p))
    return paths
