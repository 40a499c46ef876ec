"""bigbatch.jax tests: skipped without jax; float64 throughout (``jax_enable_x64``)."""

import os
import sys

import pytest

pytest.importorskip("jax")
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, os.path.dirname(__file__))
