"""Reading option values: a YAML value or a flag's text read as its option's type (one reader
for both, so a flag and a YAML key give the same value and the same error), the lines of a
YAML file's keys (for messages, and to refuse a key given twice), and path options made
absolute (a YAML file's relative paths are read from its folder, a flag's from the working
directory)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, shown

__all__ = ["parse_typed", "PARSERS", "comma_list", "number_list", "key_lines", "PATH_KEYS",
           "resolve_path", "memory_size", "SIZE_UNITS"]


def _bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{what} must be true or false, got {shown(value)}")


def _int(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)  # a flag's text
        except ValueError:
            pass
    raise ConfigError(f"{what} must be an integer, got {shown(value)}")


def _float(value: Any, what: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # a flag's text; YAML reads 2e-5 as a string
        except ValueError:
            pass
    raise ConfigError(f"{what} must be a number, got {shown(value)}")


def _int_or_word(value: Any, what: str, word: str, expected: str) -> int | str:
    """An integer (or its text), or ``word``; otherwise a refusal saying it is not
    ``expected``, the value shown bounded."""
    if isinstance(value, str) and value.strip().lower() == word:
        return word
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(f"{what} must be {expected}, got {shown(value)}")


def _int_or_auto(value: Any, what: str) -> int | str:
    """A number of rows or tokens, or ``auto`` (sized for ``--memory-budget``)."""
    return _int_or_word(value, what, "auto", "an integer or auto")


def _steps_or_epoch(value: Any, what: str) -> int | str:
    """A number of steps, or ``epoch`` (``--refresh-negatives-every``)."""
    return _int_or_word(value, what, "epoch", "a number of steps or epoch")


# a size's unit -> bytes: binary, as the memory the start line reports (1 GB = 1024 MB)
SIZE_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%|[kmgt]?i?b?)\s*$", re.IGNORECASE)


def memory_size(value: Any, what: str) -> float | int:
    """A memory budget: a fraction of the free memory (a number in (0, 1], or a percentage
    ``80%``) as a float, or a size (``20GB``, ``512MB``, ``1.5GiB``, bytes without a unit) as
    an int of bytes; units are binary (``GB`` and ``GiB`` both 2**30 bytes).

    Raises:
        ConfigError: anything else, naming ``what``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a fraction (0.8) or a size (20GB), got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise ConfigError(f"{what} must be a fraction of the free memory (0.8) or a size "
                          f"(20GB, 512MB), got {value!r}")
    if unit == "%":
        number, unit = number / 100, ""
    if not unit and number <= 1:
        if number <= 0:
            raise ConfigError(f"{what}: a fraction of the free memory must be > 0, got "
                              f"{value!r}")
        return number
    size = int(number * SIZE_UNITS[unit.rstrip("ib")[:1]])
    if size < 2 ** 20:
        raise ConfigError(f"{what}: {value!r} is less than 1 MB; give a fraction of the free "
                          f"memory (0.8) or a size with its unit (20GB, 512MB)")
    return size


def _str(value: Any, what: str) -> str:
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigError(f"{what} must be a string, got {shown(value)}")


def comma_list(text: str) -> list[str]:
    """The entries of a comma-separated list ("query, value" -> ["query", "value"])."""
    return [v.strip() for v in text.split(",") if v.strip()]


def _strings(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return comma_list(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"{what} must be a list of strings, got {shown(value)}")


def _sources(value: Any, what: str) -> str | list:
    """A path, a comma list, or a list of paths and mappings (checked by parse_sources)."""
    if isinstance(value, (str, list)):
        return value
    raise ConfigError(f"{what} must be a path or a list of sources, got {shown(value)}")


def number_list(value: Any, kind: type, what: str) -> list:
    """A list of ``kind`` (int or float) from a list or a comma-separated string ("384,128").

    Raises:
        ConfigError: an entry that is not such a number, naming ``what``.
    """
    items = comma_list(value) if isinstance(value, str) \
        else value if isinstance(value, list) else None
    if items is None:
        raise ConfigError(f"{what} must be a list of numbers, e.g. 384,256,128, got {shown(value)}")
    out = []
    for v in items:
        try:
            if isinstance(v, bool) or (kind is int and isinstance(v, float)):
                raise ValueError
            out.append(kind(v))
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: {shown(v)} is not {'an integer' if kind is int else 'a number'}"
                              f" (give a comma-separated list, e.g. 384,256,128)") from None
    return out


# an option's type (without None) -> how a value of it is read from YAML or a flag's text
PARSERS: dict[tuple[Any, ...], Callable[[Any, str], Any]] = {
    (bool,): _bool, (int,): _int, (float,): _float, (str,): _str,
    (list[int],): lambda v, what: number_list(v, int, what),
    (list[float],): lambda v, what: number_list(v, float, what),
    (list[str],): _strings, (str, list): _sources,
    (int, str): _int_or_auto,  # a chunk size or token budget, or auto
    (str, int): _steps_or_epoch,  # (declared str | int) steps, or epoch
    (float, int): memory_size,  # --memory-budget: a fraction or a size
}


def parse_typed(kinds: tuple[Any, ...], optional: bool, value: Any, what: str) -> Any:
    """``value`` read as the type ``kinds`` (the option's type without None; None allowed when
    ``optional``), from a YAML value or a flag's text: numbers from text (ints accepted for
    floats), lists from comma-separated text, booleans only as such; ``what`` names it in
    errors (``c.yaml:3: batch_size``, ``--batch-size``).

    Raises:
        ConfigError: ``<what> must be an integer, got 'x'`` (and so on for each type).
    """
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{what} must not be empty")
    return PARSERS[kinds](value, what)


def key_lines(text: str, source: str) -> dict[Any, int]:
    """The line (1-based) of each top-level key of a YAML mapping, for error messages.

    Raises:
        ConfigError: a key given twice (also spelled once with ``-`` and once with ``_``),
            which YAML would settle silently by taking the last.
    """
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:  # pragma: no cover - safe_load already parsed it
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    out: dict[Any, int] = {}
    first: dict[str, tuple[Any, int]] = {}
    for key, _ in node.value:
        try:
            name = yaml.safe_load(yaml.serialize(key))
        except yaml.YAMLError:  # pragma: no cover
            continue
        line = key.start_mark.line + 1
        norm = str(name).replace("-", "_")
        if norm in first:
            was, at = first[norm]
            raise ConfigError(f"{source}:{line}: {shown(name)} is given twice (also {shown(was)} at line "
                              f"{at}); YAML would silently take the last: keep one")
        first[norm] = (name, line)
        out[name] = line
    return out


PATH_KEYS = ("model", "train_data", "eval_data", "output_dir", "resume", "data_root",
              "guide_model", "deepspeed", "negatives_corpus")
_SOURCE_OPTIONS = ("train_data", "eval_data")


def resolve_path(key: str, value: Any, base: Path) -> Any:
    """A path option made absolute: ``~`` is the home folder, a relative path is read from
    ``base`` (the YAML file's folder, or the working directory for a flag). A ``model`` that
    is no folder there stays as given: a hub name (``namespace/name``); so does ``resume``
    ``auto``."""
    if key in _SOURCE_OPTIONS:
        return _sources_resolved(value, base)
    if not isinstance(value, str) or not value or (key == "resume" and value == "auto"):
        return value  # (--resume auto: this output folder's run, not a path)
    path = Path(value).expanduser()
    if not path.is_absolute():
        if key in ("model", "guide_model") and not (base / path).exists():
            return value  # a hub name, a missing folder check_model_source names, "self"
        path = base.absolute() / path
    return os.path.normpath(path)


def _sources_resolved(value: Any, base: Path) -> Any:
    """``--train-data`` / ``--eval-data`` with every path made absolute: one path stays a
    string; a comma list or a list becomes a list (a one-path list a string), each mapping's
    ``path`` resolved."""
    if isinstance(value, str):
        value = comma_list(value) if "," in value else value
    if isinstance(value, str):
        return resolve_path("data", value, base) if value else value
    if not isinstance(value, list):
        return value
    out = []
    for entry in value:
        if isinstance(entry, str):
            out.append(resolve_path("data", entry, base))
        elif isinstance(entry, dict) and isinstance(entry.get("path"), str):
            out.append({**entry, "path": resolve_path("data", entry["path"], base)})
        else:
            out.append(entry)  # parse_sources names what is wrong with it
    return out[0] if len(out) == 1 and isinstance(out[0], str) else out
