"""``bigbatch train``: one flag per :class:`~bigbatch.train.TrainConfig` field, listed by
section; ``--config file.yaml`` supplies values the flags override."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .options import add_field_flag

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, name: str) -> None:
    from ..train.config import SECTIONS, TrainConfig

    p = sub.add_parser(name, help="fine-tune a bi-encoder with GradCache")
    p.add_argument("--config", default=None, help="YAML file of options; flags override it; "
                   "relative paths in it are read from the YAML file's folder (on the command "
                   "line, from the working directory)")
    groups = {section: p.add_argument_group(f"{section} options", what)
              for section, what in SECTIONS.items()}
    for f in dataclasses.fields(TrainConfig):  # given flags only: the rest stays unset
        add_field_flag(groups[f.metadata["section"]], f)


def run(args: argparse.Namespace) -> int:
    from ..engine import distributed as D
    from ..retrieval.report import print_summary
    from ..train import load_config, train

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    config = load_config(args.config, overrides)
    summary = train(config)
    if D.world_info().is_main:  # the global main rank (under torchrun: RANK 0, of any node)
        print_summary(summary, config.best_metric, config.eval_split)
    return 0
