"""The package face: ``bb.*`` keeps every name it had before the rooms moved, and each one
resolves (to the object of the module that defines it)."""

from __future__ import annotations

import importlib
import importlib.metadata

import pytest

import bigbatch as bb

# bb.__all__ before the modules moved into engine/ and losses/ (issue 28): kept, never shrunk
BEFORE = ["GradCache", "StepResult", "InfoNCE", "CorpusInfoNCE", "LogitScale", "LossOutput",
          "RandContext", "TokenEmbeddings", "MaxSimInfoNCE", "Matryoshka", "functional",
          "distributed", "errors", "BigBatchError", "ConfigError", "InputError", "ShapeError",
          "NonFiniteError", "DataError", "RankFailedError", "__version__"]

# where each name is defined: bb.X is that object
HOMES = {"GradCache": "bigbatch.engine.gradcache", "StepResult": "bigbatch.engine.gradcache",
         "RandContext": "bigbatch.engine.rng", "TokenEmbeddings": "bigbatch.engine.embeddings",
         "InfoNCE": "bigbatch.losses.infonce", "CorpusInfoNCE": "bigbatch.losses.corpus",
         "LogitScale": "bigbatch.losses.base", "LossOutput": "bigbatch.losses.base",
         "MaxSimInfoNCE": "bigbatch.losses.maxsim", "Matryoshka": "bigbatch.losses.matryoshka",
         "BigBatchError": "bigbatch.errors", "ConfigError": "bigbatch.errors",
         "InputError": "bigbatch.errors", "ShapeError": "bigbatch.errors",
         "NonFiniteError": "bigbatch.errors", "DataError": "bigbatch.errors",
         "RankFailedError": "bigbatch.errors"}
MODULES = {"functional": "bigbatch.engine.functional", "distributed": "bigbatch.engine.distributed",
           "errors": "bigbatch.errors"}


def test_all_keeps_every_name_it_had():
    assert sorted(set(BEFORE) - set(bb.__all__)) == []
    assert len(bb.__all__) == len(set(bb.__all__))


def test_every_public_name_resolves():
    for name in bb.__all__:
        assert getattr(bb, name) is not None, name
    assert bb.__version__ == importlib.metadata.version("bigbatch")
    assert sorted(set(HOMES) | set(MODULES) | {"__version__"}) == sorted(BEFORE)
    for name, module in HOMES.items():
        assert getattr(bb, name) is getattr(importlib.import_module(module), name), name
    for name, module in MODULES.items():
        assert getattr(bb, name) is importlib.import_module(module), name
    assert set(dir(bb)) >= set(bb.__all__)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        getattr(bb, "NoSuchThing")
