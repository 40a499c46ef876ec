"""The ``bigbatch`` command line: ``train``, ``eval``, ``mine``, ``merge`` and the data tools,
one module per command (:mod:`~bigbatch.cli.train`, :mod:`~bigbatch.cli.eval`,
:mod:`~bigbatch.cli.mine`, :mod:`~bigbatch.cli.merge`, :mod:`~bigbatch.cli.data`,
:mod:`~bigbatch.cli.convert`).

Every option of :class:`bigbatch.train.TrainConfig` is a flag spelled with dashes
(``--grad-cache-chunk``); ``--config file.yaml`` supplies values that flags override.
Errors a user can cause print one clear line (file, line, field or option) and exit 2;
Ctrl-C prints where the work stopped (for ``train``: how to continue) and exits 130.
The parser imports no torch: ``bigbatch --help`` answers at once.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import BigBatchError
from . import convert, data, merge, mine, train
from . import eval as eval_

__all__ = ["main", "build_parser"]

# each command, in the order --help lists them: (the function adding its parser, its run)
_COMMANDS: dict[str, tuple[Callable[[Any, str], None], Callable[[argparse.Namespace], int]]] = {
    "train": (train.add_parser, train.run),
    "validate": (data.add_validate, data.validate),
    "convert": (convert.add_parser, convert.run),
    "mine": (mine.add_parser, mine.run),
    "eval": (eval_.add_parser, eval_.run),
    "merge": (merge.add_parser, merge.run),
    "make-pairs": (data.add_make_pairs, data.make_pairs),
    "render-pages": (data.add_render_pages, data.render_pages),
    "data": (data.add_fetch, data.fetch),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``bigbatch`` and its subcommands (the CLI reference is made from it)."""
    parser = argparse.ArgumentParser(prog="bigbatch", description="Exact GradCache training "
                                     "of embedding models at batch sizes beyond memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, _) in _COMMANDS.items():
        add(sub, name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt as e:  # Ctrl-C: where it stopped, no traceback
        from ..train.loop import RunInterrupted

        print(str(e) if isinstance(e, RunInterrupted) else
              f"bigbatch {args.command}: stopped (Ctrl-C)" + (
                  ", before training began; nothing was written" if args.command == "train"
                  else ""), file=sys.stderr, flush=True)
        return getattr(e, "exit_code", 130)  # a preempted run (SIGTERM, SIGUSR1): 75


def _run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names; a bigbatch error prints one line and gives 2."""
    try:
        return _COMMANDS[args.command][1](args)
    except BigBatchError as e:
        print(f"bigbatch: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an output the command could not write: named, not a traceback
        if e.errno not in _WRITE_ERRORS:
            raise
        from ..train.durable import failed_write

        # (every command writes its outputs beside them and renames them into place when
        # complete, so what was there before is left as it was)
        print(f"bigbatch: error: {args.command}: "
              f"{failed_write(e.filename or 'its output', e, 'run it again', run=False)}",
              file=sys.stderr)
        return 2


# what a write can meet on a machine: a full disk or quota, a read-only file system
_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
