"""``bigbatch eval``: full-corpus retrieval metrics of one or more models; and the encoder
options it shares with ``mine``: the model-folder fields of
:class:`~bigbatch.train.TrainConfig` (left out: what the model folder says), the batch of
texts embedded at once, the device and the corpus embedding cache."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .options import DefaultsFormatter, add_field_flag, check_positive, config_field, number_list_type

__all__ = ["add_parser", "run", "add_encoder_flags", "encoder_overrides", "check_encoder_args",
           "cache_dir"]


def _encoder_fields() -> list[dataclasses.Field]:
    """The fields of how a model embeds whose default is what the model folder says."""
    from ..train.config import TrainConfig

    return [f for f in dataclasses.fields(TrainConfig) if f.metadata["from_model_folder"]]


def add_encoder_flags(p: argparse.ArgumentParser) -> None:
    for f in _encoder_fields():
        add_field_flag(p, f, default=None, refuse_choices=True)
    batch = config_field("eval_batch_size")
    add_field_flag(p, batch, "--batch-size", default=batch.default, help=(
        "texts embedded at once, queries and documents (what train's --eval-batch-size sets; "
        "not train's --batch-size, the queries of a training step)"))
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if "
                   "present, else cpu)")
    p.add_argument("--cache-dir", default=None, help="corpus embedding cache (default: "
                   "$BIGBATCH_CACHE or ~/.cache/bigbatch)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the cache")


def encoder_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The encoder options given (None: what the model folder says), for ``load_encoder``."""
    return {f.name: getattr(args, f.name) for f in _encoder_fields()}


def check_encoder_args(args: argparse.Namespace) -> str:
    """The encoder options of ``eval`` / ``mine`` checked before any model loads; returns the
    device to use.

    Raises:
        ConfigError: a size that is not positive, a device this machine does not have.
    """
    from ..train.config import device_problem

    check_positive(args, ("batch_size", "max_length", "max_num_visual_tokens",
                          "min_num_visual_tokens"))
    if args.device is not None and (problem := device_problem(args.device)):
        raise ConfigError(f"--device: {problem} (got {args.device!r})")
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def cache_dir(args: argparse.Namespace) -> Path | None:
    """The corpus embedding cache ``--cache-dir`` names (None with ``--no-cache``)."""
    from ..data.readers.files import default_cache_dir

    return None if args.no_cache else (args.cache_dir or default_cache_dir())


def add_parser(sub: Any, name: str) -> None:
    ev = sub.add_parser(name, help="full-corpus retrieval metrics of one or more models",
                        formatter_class=DefaultsFormatter)
    ev.add_argument("--model", action="append", required=True,
                    help="model folder (base, final/, checkpoint); repeat to compare")
    ev.add_argument("--data", required=True, help="BEIR directory")
    ev.add_argument("--split", default="test", help="qrels split to evaluate on")
    ev.add_argument("--unseen-from", default=None, help="also report queries whose "
                    "relevant documents are not in this split's qrels ('' to skip; default: "
                    "train, when the data has qrels/train.tsv)")
    ev.add_argument("--output", default=None, help="write the results as JSON here "
                    "(default: printed only)")
    ev.add_argument("--dims", type=number_list_type(int, "--dims"), default=None,
                    help="Matryoshka widths, e.g. 384,128: one row per width, each from the "
                    "embeddings' first dims coordinates normalised again (the corpus is "
                    "embedded once; default: the full embeddings only)")
    ev.add_argument("--task", default=None, help="embed with the prompts a bigbatch model "
                    "saved for this task (a training source's name; see "
                    "docs/guides/multi-dataset.md) (default: the task named as the --data "
                    "folder, when the model has one, else the model's own prompts)")
    add_encoder_flags(ev)


def run(args: argparse.Namespace) -> int:
    from ..data.readers.beir_dir import require_split
    from ..data.readers.files import check_writable_file
    from ..encoders import load_encoder
    from ..retrieval.evaluate import evaluate_beir, evaluate_beir_dims
    from ..retrieval.report import format_eval_table, json_text
    from ..train.durable import write_text_safely
    from ..train.outdir import check_not_input

    if args.output:  # before evaluating, so that no evaluation is lost
        check_writable_file(args.output, "--output", create_folders=False)
        check_not_input(args.output, "--output", [("--data", args.data)]
                        + [("--model", m) for m in args.model])
    if args.unseen_from:  # a split named on purpose must exist (the default's may not)
        require_split(args.data, args.unseen_from, "--unseen-from")
    unseen_from = "train" if args.unseen_from is None else args.unseen_from or None
    device = check_encoder_args(args)
    if args.dims is not None:
        from ..losses.matryoshka import check_dims
        check_dims(args.dims, what="--dims")
    overrides = encoder_overrides(args)
    results = []
    for path in args.model:
        encoder = load_encoder(path, **overrides).to(device)
        task = args.task if args.task is not None else Path(args.data).name
        if args.task is not None and args.task not in encoder.tasks:
            raise ConfigError(f"--task: {path} has no task {args.task!r} (it has: "
                              f"{', '.join(sorted(encoder.tasks)) or 'none'})")
        given = {s: overrides[a] for s, a in encoder.prompt_attrs.items()}
        prompts = {s: v for s, v in encoder.task_prompts(task).items() if given[s] is None}
        common = dict(batch_size=args.batch_size, device=device, unseen_from=unseen_from,
                      cache_dir=cache_dir(args))
        with encoder.using_prompts(**prompts):  # a prefix given on the command line wins
            if args.dims is None:
                metrics = evaluate_beir(encoder, args.data, args.split, **common)
                results.append({"model": str(path), "data": str(args.data),
                                "split": args.split, "metrics": metrics})
                continue
            per_dim = evaluate_beir_dims(encoder, args.data, args.dims, args.split, **common)
        results.extend({"model": f"{path} @{dim}", "dim": dim, "data": str(args.data),
                        "split": args.split, "metrics": metrics}
                       for dim, metrics in per_dim.items())
    print(format_eval_table(results))
    if args.output:  # strict JSON, written whole or not at all
        write_text_safely(args.output, json_text(results, indent=2), "evaluate again",
                          run=False)
        print(f"wrote {args.output}")
    return 0
