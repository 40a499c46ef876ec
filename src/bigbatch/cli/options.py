"""What the commands' flags share: the help formatter that states defaults, flags made from
:class:`~bigbatch.train.TrainConfig` fields (their help, choices and value parser are the
field's), and the check of numeric options."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError

__all__ = ["DefaultsFormatter", "argparse_type", "config_field", "field_help", "add_field_flag",
           "number_list_type", "check_positive"]


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the help states it itself
    ("default: ..."), the option is required, or it has none (None); a flag says "off"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = action.help or ""
        if not action.option_strings or "default" in help_ or action.required \
                or action.default in (None, argparse.SUPPRESS):
            return help_
        if action.default is False and action.nargs == 0:
            return f"{help_} (default: off)"
        return f"{help_} (default: %(default)s)"


def argparse_type(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``parse(text)``, its :class:`ConfigError` an argparse error
    ("argument --batch-size: must be an integer, got 'x'")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(flag).lstrip(": ")) from None

    return convert


def number_list_type(kind: type, flag: str) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of ``kind`` (int or float)."""
    from ..train.config import number_list

    return argparse_type(lambda text: number_list(text, kind, flag), flag)


def config_field(name: str) -> dataclasses.Field:
    """The :class:`~bigbatch.train.TrainConfig` field ``name``."""
    from ..train.config import TrainConfig

    return next(f for f in dataclasses.fields(TrainConfig) if f.name == name)


def field_help(f: dataclasses.Field) -> str:
    """A field's help as its flag shows it, ending with its default (unless the help states
    it or the option is required)."""
    from ..train.config import option_type

    help_, kinds = f.metadata["help"], option_type(f.name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if f.metadata["from_model_folder"]:
        shown = f.metadata["default_text"] or ("none" if default in ("", None) else default)
        return f"{help_} (default: what the model folder says, else {shown})"
    if kinds == (bool,):
        return f"{help_} (default {'on' if default else 'off'})"
    if "(default:" in help_ or help_.startswith("required") or list in map(typing.get_origin, kinds):
        return help_
    return f"{help_} (default {default})"


def add_field_flag(p: Any, f: dataclasses.Field, flag: str | None = None, *,
                   default: Any = argparse.SUPPRESS, refuse_choices: bool = False,
                   help: str | None = None) -> None:
    """The flag of the :class:`~bigbatch.train.TrainConfig` field ``f`` (``--`` and its name
    with dashes, or ``flag``): its help, and its values read by
    :func:`~bigbatch.train.config.parse_value`. Its choices are listed, and refused by argparse
    with ``refuse_choices`` (else :meth:`~bigbatch.train.TrainConfig.validate` refuses them)."""
    from ..train.config import comma_list, option_type, parse_value

    flag = flag or "--" + f.name.replace("_", "-")
    help_ = help or field_help(f)
    choices = f.metadata["choices"]
    if f.name in ("train_data", "eval_data"):  # repeatable, each a path or a comma list
        p.add_argument(flag, action="extend", default=default, help=help_, type=comma_list)
    elif option_type(f.name) == (bool,):
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
    else:
        p.add_argument(flag, default=default, help=help_,
                       type=argparse_type(lambda text: parse_value(f.name, text, flag), flag),
                       **({"choices": choices} if refuse_choices and choices else
                          {"metavar": "{" + ",".join(choices) + "}"} if choices else {}))


def check_positive(args: argparse.Namespace, names: Sequence[str], at_least: int = 1) -> None:
    """Refuse a numeric option below ``at_least`` (None: not given, fine).

    Raises:
        ConfigError: naming the option and the value.
    """
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < at_least:
            raise ConfigError(f"--{name.replace('_', '-')}: must be "
                              f"{'> 0' if at_least == 1 else f'>= {at_least}'} (got {value})")
