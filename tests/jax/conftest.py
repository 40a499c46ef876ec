"""bigbatch.jax tests: skipped without jax; float64 throughout (``jax_enable_x64``)."""

import os
import sys

import pytest

# the tests' programs are small: compile them fast (on 2 shared cores compiling dominates)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_backend_optimization_level=0",
                                    "--xla_llvm_disable_expensive_passes=true"]).strip()
pytest.importorskip("jax")
import jax

jax.config.update("jax_enable_x64", True)
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]
