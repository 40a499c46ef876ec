"""Package faces whose public names are imported on first use: ``from bigbatch.train import
train`` imports the training loop (and torch) when it is asked for, so that a light module
of the same package (``bigbatch.train.config`` for ``bigbatch train --help``) stays light."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, names: Mapping[str, str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package ``package`` whose public names are
    ``names`` (name -> the submodule that defines it, e.g. ``".loop"``); a submodule's own
    name (``bigbatch.train.checkpoint``) resolves to the submodule."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name], package), name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
