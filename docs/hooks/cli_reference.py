"""An mkdocs hook: the CLI reference page (docs/reference/cli.md) is generated at build time
from ``bigbatch.cli.build_parser()``, the parser ``bigbatch --help`` prints, so the page never
drifts from the command. The page's marker line ``<!-- bigbatch-cli -->`` is replaced by one
section per subcommand (and per subcommand of a group, such as ``bigbatch data fetch``): its
options in a table (flags, help with the default, as ``--help`` words it) and the ``--help``
text itself.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- bigbatch-cli -->"
WIDTH = "100"  # columns argparse wraps --help to on the page


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of each subcommand, in the order --help lists them."""
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _cell(text: str) -> str:
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|").replace("*", "\\*")


def _flags(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    arg = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"`{s} {arg}`" for s in action.option_strings)


def command_markdown(name: str, summary: str, parser: argparse.ArgumentParser) -> str:
    """The section of one subcommand: summary, options table, and its --help text."""
    formatter = parser._get_formatter()
    rows = ["| option | what it does |", "| --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        help_ = formatter._expand_help(action) if action.help else ""
        if action.choices and not isinstance(action.choices, dict):
            help_ += f" (one of: {', '.join(map(str, action.choices))})"
        if action.required:
            help_ = help_ if help_.startswith("required") else f"required: {help_}"
        rows.append(f"| {_flags(action, formatter)} | {_cell(help_)} |")
    return "\n".join([
        f"## bigbatch {name}", "", f"{summary[:1].upper()}{summary[1:]}.", "",
        *rows, "",
        f'??? note "`bigbatch {name} --help`"', "",
        "    ```text",
        *("    " + line if line else "" for line in parser.format_help().rstrip().splitlines()),
        "    ```", "",
    ])


def _sections(prefix: str, parser: argparse.ArgumentParser) -> list[str]:
    """A section per subcommand of ``parser``; one with subcommands of its own (``bigbatch
    data fetch``) gets a short section naming them, then theirs."""
    out = []
    for name, summary, sub in _subcommands(parser):
        nested = _subcommands(sub)
        if not nested:
            out.append(command_markdown(prefix + name, summary, sub))
            continue
        names = ", ".join(f"`bigbatch {prefix}{name} {n}`" for n, _, _ in nested)
        out += [f"## bigbatch {prefix}{name}", "", f"{summary[:1].upper()}{summary[1:]}: "
                f"{names}.", ""]
        out += _sections(f"{prefix}{name} ", sub)
    return out


def cli_markdown() -> str:
    """The whole generated reference: the top-level usage, then each subcommand."""
    from bigbatch.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        parts = ["```text", parser.format_usage().strip(), "```", ""]
        parts += _sections("", parser)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


def on_config(config: Any, **kwargs: Any) -> Any:
    src = str(Path(config.config_file_path).parent / "src")
    if src not in sys.path:  # a checkout that is not installed builds its own source
        sys.path.insert(0, src)
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_markdown())
    return markdown
