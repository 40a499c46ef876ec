"""``bigbatch merge``: saved models (a run's checkpoints, ``best/``, ``final/``, or other
saved model folders) averaged into one, or two interpolated spherically, written as a run's
``final/`` is (:mod:`bigbatch.train.merge`)."""

from __future__ import annotations

import argparse
from typing import Any

from .options import DefaultsFormatter

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, name: str) -> None:
    me = sub.add_parser(name, help="average checkpoints or models into one (LoRA adapters in "
                        "adapter space), or interpolate two spherically",
                        formatter_class=DefaultsFormatter)
    me.add_argument("models", nargs="+", metavar="CKPT", help="checkpoint-N/, best/, final/ "
                    "or a saved model folder (two or more)")
    me.add_argument("--output", required=True, help="a new folder for the merged model (never "
                    "an input, inside one or holding one); it loads as a run's final/ does")
    # one place for the choices: bigbatch.train.merge.METHODS (checked there)
    me.add_argument("--method", default="mean", help="mean: the uniform average of the "
                    "models; slerp: the spherical interpolation of two, tensor by tensor")
    me.add_argument("--weight", type=float, default=None, help="slerp: t, from the first "
                    "model (0) to the second (1) (default: 0.5)")


def run(args: argparse.Namespace) -> int:
    from ..train.merge import merge_models

    report = merge_models(args.models, args.output, method=args.method, weight=args.weight)
    print(f"bigbatch merge: {report.line()}")
    return 0
