"""Reading a YAML file a user gives (a ``--config`` file, a checkpoint's ``config.yaml``)
safely: a regular file of bounded size, PyYAML's safe loader (plain values only: no Python
objects), and aliases that cannot multiply.

YAML's aliases (``*name``) repeat a value without copying it, so a 436-byte file of nine
aliases of nine aliases ("billion laughs") stands for 10**9 values: any code that walks or
prints it (a message showing the value) runs out of memory. Here the document is composed
first, its values counted as its aliases expand them (each node once), and a file that
expands to more than :data:`MAX_YAML_VALUES` values, or nests deeper than
:data:`MAX_YAML_DEPTH` (or refers to itself), is refused before any Python value is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .files import open_regular

__all__ = ["load_yaml", "MAX_YAML_VALUES", "MAX_YAML_DEPTH", "MAX_YAML_BYTES"]

MAX_YAML_VALUES = 100_000  # values a YAML file may stand for, its aliases expanded
MAX_YAML_DEPTH = 100  # levels of nesting
MAX_YAML_BYTES = 16 * 2**20  # a configuration file


def _expanded(node: Any, memo: dict[int, int], depth: int, where: str) -> int:
    """How many values ``node`` stands for, each alias counted as often as it is used."""
    import yaml

    key = id(node)
    if key in memo:
        if memo[key] < 0:  # met again inside itself: an alias to a value that holds it
            raise ConfigError(f"{where}: an alias refers to a value that holds it (a value "
                              f"without end); bigbatch reads plain configurations: write the "
                              f"values out")
        return memo[key]
    if depth > MAX_YAML_DEPTH:
        raise ConfigError(f"{where}: nested more than {MAX_YAML_DEPTH} levels deep; bigbatch "
                          f"reads plain configurations: write the values out")
    memo[key] = -1  # being counted
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded(c, memo, depth + 1, where) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded(k, memo, depth + 1, where) + _expanded(v, memo, depth + 1, where)
                    for k, v in node.value)
    else:
        n = 1
    memo[key] = n
    return n


def load_yaml(path: str | Path, what: str = "a YAML file") -> Any:
    """The values of the YAML file ``path`` (None for an empty one), read as described in
    the module; ``what`` names the file in a message about its size.

    Raises:
        ConfigError: naming the file: it cannot be read (missing, not a regular file, over
            :data:`MAX_YAML_BYTES`), is not valid YAML, holds Python objects, nests too deep
            or expands through its aliases to too many values.
    """
    import yaml

    try:
        with open_regular(path, "rb", MAX_YAML_BYTES, what) as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it "
                          f"as UTF-8") from e
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded(node, {}, 0, str(path))
        if size > MAX_YAML_VALUES:
            raise ConfigError(f"{path}: its aliases (*name) expand it to {size:,} values, over "
                              f"the {MAX_YAML_VALUES:,} bigbatch reads (a 'billion laughs' "
                              f"file?); write the values out, or use fewer aliases")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e)[:1000]}") from e
    except RecursionError as e:
        raise ConfigError(f"{path}: nested too deep to read; bigbatch reads plain "
                          f"configurations: write the values out") from e
    finally:
        loader.dispose()
